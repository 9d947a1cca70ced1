"""Issue 14 item 1: initialize as Apex kept it, the amp state living with each optimizer.

Several ``initialize`` calls on one Amp (the default one too): each optimizer keeps the
settings and loss scalers of its own call. Objects passed again come back unchanged (same
settings) or raise (other settings); a failed initialize changes nothing.
"""

from __future__ import annotations

import logging

import pytest
import torch

from adapters.apex import amp as apex_amp
from adapters.apex.amp import Amp, AmpError

F16, F32 = torch.float16, torch.float32


def make(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def data(n=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def step(amp, model, opt, x, inject=False):
    opt.zero_grad()
    with amp.autocast():
        loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if inject:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def alone(level, seed, xs, inject_at=()):
    amp = Amp()
    m, o = make(seed)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
    for i, x in enumerate(xs):
        step(amp, m, o, x, i in inject_at)
    return params(m), amp.loss_scale()


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
def test_two_initialize_calls_both_optimizers_step(default):
    amp = apex_amp if default else Amp()
    xs = data()
    m1, o1 = make(0)
    m1, o1 = amp.initialize(m1, o1, opt_level="O2", verbosity=0)
    m2, o2 = make(1)
    m2, o2 = amp.initialize(m2, o2, opt_level="O1", verbosity=0)
    for i, x in enumerate(xs):
        step(amp, m1, o1, x, inject=(i == 1))  # an overflow in the first run only
        step(amp, m2, o2, x)
    ref1, scale1 = alone("O2", 0, xs, inject_at=(1,))
    ref2, scale2 = alone("O1", 1, xs)
    assert all(torch.equal(a, b) for a, b in zip(params(m1), ref1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params(m2), ref2, strict=True))
    # as in Apex, the latest initialize's loss scalers serve every optimizer (Apex kept
    # them in the global _amp_state): o1's overflow halved the scale o2 uses too
    assert scale1 == 32768.0 and scale2 == 65536.0
    assert amp.loss_scale() == 32768.0
    assert o1._amp_stash.session.loss_scalers[0].loss_scale.item() == 65536.0  # unused
    inst = apex_amp.default_amp() if default else amp
    assert inst.properties.opt_level == "O1"


def test_reference_run_disabled_beside_the_real_one():
    amp = Amp()
    xs = data()
    ref_m, ref_o = make(0)
    ref_m, ref_o = amp.initialize(ref_m, ref_o, enabled=False, verbosity=0)
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    loss = ref_m(xs[0]).pow(2).mean()
    with amp.scale_loss(loss, ref_o) as scaled:
        assert scaled is loss  # pass-through, as with enabled=False in Apex
        scaled.backward()
    ref_o.step()
    step(amp, m, o, xs[0])
    torch.manual_seed(0)
    plain_m, plain_o = make(0)
    plain_o.zero_grad()
    plain_m(xs[0]).pow(2).mean().backward()
    plain_o.step()
    assert all(torch.equal(a, b) for a, b in zip(params(ref_m), params(plain_m), strict=True))
    assert m[0].weight.dtype == F16 and ref_m[0].weight.dtype == F32
    # the disabled optimizer may be initialized for real later
    _, ref_o2 = amp.initialize(ref_m, ref_o, opt_level="O1", verbosity=0)
    assert ref_o2._amp_stash.session.properties.opt_level == "O1"


def test_same_objects_again_same_level_returned_unchanged(caplog):
    amp = Amp()
    xs = data()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    step(amp, m, o, xs[0])
    fwd, groups, rec = m.forward, [list(g["params"]) for g in o.param_groups], o._amp_stash
    with caplog.at_level(logging.WARNING, logger="adapters.apex"):
        m2, o2 = amp.initialize(m, o, opt_level="O2", verbosity=0)  # the cell run twice
    assert m2 is m and o2 is o and m.forward == fwd and o._amp_stash is rec
    assert [list(g["params"]) for g in o.param_groups] == groups
    assert "returned unchanged" in caplog.text
    for x in xs[1:]:
        step(amp, m, o, x)
    ref, _ = alone("O2", 0, xs)
    assert all(torch.equal(a, b) for a, b in zip(params(m), ref, strict=True))


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_same_objects_again_other_level_raises_and_changes_nothing(what):
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O1", verbosity=0)
    before = params(m)
    fwd, rec = m.forward, o._amp_stash
    m_new, o_new = make(1)
    args = (m, o_new) if what == "model" else (m_new, o)
    with pytest.raises(AmpError, match=r"already initialized.*opt_level: 'O1' -> 'O2'"):
        amp.initialize(*args, opt_level="O2", verbosity=0)
    assert m.forward == fwd and o._amp_stash is rec and amp.properties.opt_level == "O1"
    assert all(torch.equal(a, b) for a, b in zip(params(m), before, strict=True))
    # the new objects of the failed call were left alone too
    assert not hasattr(o_new, "_amp_stash") and m_new[0].weight.dtype == F32
    assert "forward" not in m_new.__dict__


def test_failed_initialize_changes_nothing_and_a_retry_works():
    amp = Amp()
    m, o = make(0)
    w = m[0].weight
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 5}})
    with pytest.raises(AmpError, match=r"fixed loss_scale=1\.0"):
        amp.initialize(m, o, opt_level="O3", verbosity=0)  # a dynamic checkpoint at O3
    assert m[0].weight is w and w.dtype == F32 and "forward" not in m.__dict__
    assert not hasattr(o, "_amp_stash") and o.param_groups[0]["params"][0] is w
    assert not amp.initialized
    for bad in (dict(opt_level="O9"), dict(num_losses=0), dict(max_loss_scale=-1.0),
                dict(verbosity="loud"), dict(opt_level="O1", master_weights=True)):
        with pytest.raises(AmpError):
            amp.initialize(m, o, **{"verbosity": 0, **bad})
        assert w.dtype == F32 and not hasattr(o, "_amp_stash")
    # the retry: same objects, a level the checkpoint fits
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert w.dtype == F16 and amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0,
                                                                   "unskipped": 5}


def test_optimizer_of_another_amp_and_mixed_calls():
    a, b = Amp(), Amp()
    m, o = make(0)
    a.initialize(m, o, verbosity=0)
    with pytest.raises(AmpError, match="another Amp"):
        b.initialize(make(1)[0], o, verbosity=0)
    b.initialize(make(2)[0], verbosity=0)
    loss = m(data(1)[0]).sum()
    with pytest.raises(AmpError, match="another Amp"), b.scale_loss(loss, o):
        pass
    m2, o2 = make(1)
    a.initialize(m2, o2, verbosity=0)
    with pytest.raises(AmpError, match=r"different amp\.initialize calls"), \
            a.scale_loss(loss, [o, o2]):
        pass


def test_same_model_twice_in_one_call():
    m, _ = make(0)
    with pytest.raises(AmpError, match="same model appears twice"):
        Amp().initialize([m, m], verbosity=0)
    assert m[0].weight.dtype == F32


def test_earlier_models_and_optimizers_are_freed():
    import gc
    import weakref

    amp = Amp()
    m, o = make(0)
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    ref = weakref.ref(o)
    del m, o
    m2, o2 = make(1)
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    gc.collect()
    assert ref() is None  # the Amp holds only its latest call


def test_model_of_another_amp_gives_this_amp_a_state():
    a, b = Amp(), Amp()
    m, _ = make(0)
    a.initialize(m, opt_level="O2", verbosity=0)
    b.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 1}})
    fwd = m.forward
    assert b.initialize(m, opt_level="O2", verbosity=0) is m and m.forward is fwd
    assert b.initialized and b.loss_scale() == 512.0  # the pending checkpoint was applied
