"""Issue 14 items 4 and 6: Apex's ``_amp_state`` (read-only) and clear errors on misuse."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

import fmp
from adapters.apex import amp as apex_amp
from adapters.apex.amp import Amp, AmpError

F16, F32 = torch.float16, torch.float32


def make(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def x():
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(2))


def bits(m):
    return [p.detach().clone() for p in m.parameters()]


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------
# item 4: _amp_state
# ------------------------------------------------------------------------------------
def test_amp_state_imports_and_reads_after_an_overflow():
    from adapters.apex.amp import _amp_state
    from adapters.apex.amp._amp_state import _amp_state as same_object

    assert apex_amp._amp_state is _amp_state is same_object
    m, o = make()
    m, o = apex_amp.initialize(m, o, opt_level="O2", num_losses=2, verbosity=0,
                               min_loss_scale=4.0)
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [65536.0, 65536.0]
    with apex_amp.scale_loss(m(x()).float().sum(), o, loss_id=1) as scaled:
        scaled.backward()
        m[0].weight.grad.view(-1)[0] = float("inf")
    o.step()
    s0, s1 = _amp_state.loss_scalers
    assert (s0.loss_scale(), s1.loss_scale()) == (65536.0, 32768.0)
    assert s1.dynamic and s1._unskipped == 0 and s1._loss_scale == 32768.0
    assert s1._min_loss_scale == 4.0 and s1._max_loss_scale == 2.0**24
    p = _amp_state.opt_properties
    assert (p.enabled, p.opt_level, p.master_weights, p.cast_model_type, p.loss_scale) == \
        (True, "O2", True, F16, "dynamic")
    assert p.options["keep_batchnorm_fp32"] is True
    assert _amp_state.verbosity == 0 and _amp_state.min_loss_scale == 4.0
    assert _amp_state.hard_override is False


def test_amp_state_is_read_only_and_follows_the_latest_call():
    from adapters.apex.amp import _amp_state

    with pytest.raises(AmpError, match="read-only"):
        _amp_state.verbosity = 2
    with pytest.raises(AmpError, match="read-only"):
        _amp_state.hard_override = True  # (a scaler's _loss_scale is writable, as in Apex)
    apex_amp.initialize(make()[0], opt_level="O3", verbosity=1)
    assert _amp_state.opt_properties.opt_level == "O3" and _amp_state.verbosity == 1
    assert not _amp_state.loss_scalers[0].dynamic
    apex_amp.initialize(make()[0], enabled=False, verbosity=0)
    assert _amp_state.opt_properties.enabled is False and _amp_state.loss_scalers == []


def test_amp_state_before_initialize_and_handle():
    from adapters.apex.amp._amp_state import AmpStateView

    a = Amp()
    view = AmpStateView(lambda: a)
    with pytest.raises(AttributeError, match=r"amp\.initialize"):
        view.loss_scalers  # noqa: B018 - Apex set it in initialize
    with pytest.raises(AttributeError, match=r"amp\.init"):
        view.handle  # noqa: B018
    assert view.verbosity == 1


@pytest.mark.parametrize("name", ["adapters.apex.amp._amp_state", "adapters.apex.amp._session"])
def test_docstring_examples(name):
    import sys

    importlib.import_module(name)
    mod = sys.modules[name]
    result = doctest.testmod(mod, extraglobs={**vars(mod), "torch": torch, "fmp": fmp})
    assert result.failed == 0 and result.attempted > 0


# ------------------------------------------------------------------------------------
# item 6: misuse
# ------------------------------------------------------------------------------------
def test_scale_loss_with_no_optimizer_is_an_error():
    amp = Amp()
    m, o = make()
    m, o = amp.initialize(m, o, verbosity=0)
    before = bits(m)
    for bad in ([], (), None, "opt", [o, "opt"]):
        loss = m(x()).sum()
        with pytest.raises(AmpError, match="non-empty list of optimizers"), \
                amp.scale_loss(loss, bad):
            pass
    o.step()
    assert same(bits(m), before)


@pytest.mark.parametrize("when", ["after", "before"])
def test_dynamic_checkpoint_into_a_fixed_scale_level(when):
    src = Amp()
    m, o = make()
    src.initialize(m, o, opt_level="O2", verbosity=0)
    ckpt = src.state_dict()  # {'loss_scale': 65536.0, ...}
    amp = Amp()
    m, o = make(1)
    if when == "before":
        amp.load_state_dict(ckpt)
        with pytest.raises(AmpError, match=r"loss_scale=65536\.0.*fixed loss_scale=1\.0"):
            amp.initialize(m, o, opt_level="O3", verbosity=0)
        assert m[0].weight.dtype == F32  # nothing was changed
        return
    m, o = amp.initialize(m, o, opt_level="O3", verbosity=0)
    with pytest.raises(AmpError, match=r"loss_scale='dynamic'"):
        amp.load_state_dict(ckpt)
    assert amp.loss_scale() == 1.0
    # a fixed-scale checkpoint of the same scale loads (its counter)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 9}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 9}
    # and a dynamic level takes the checkpoint
    amp2 = Amp()
    amp2.initialize(make(2)[0], opt_level="O1", verbosity=0)
    amp2.load_state_dict(ckpt)
    assert amp2.loss_scale() == 65536.0


def test_duplicate_keys_and_wrong_types_change_nothing():
    amp = Amp()
    amp.initialize(make()[0], opt_level="O1", num_losses=2, verbosity=0)
    good = {"loss_scale": 8.0, "unskipped": 3}
    with pytest.raises(AmpError, match=r"'loss_scaler0' and 'loss_scaler00' both name"):
        amp.load_state_dict({"loss_scaler0": good, "loss_scaler00": good})
    bad_entries = [None, 3.0, [8.0, 3], {"loss_scale": 8.0},
                   {"loss_scale": "8", "unskipped": 0}, {"loss_scale": True, "unskipped": 0},
                   {"loss_scale": 8.0, "unskipped": 2.5}, {"loss_scale": 8.0, "unskipped": "3"},
                   {"loss_scale": torch.ones(2), "unskipped": 0},
                   {"loss_scale": float("nan"), "unskipped": 0}]
    for bad in bad_entries:
        with pytest.raises(AmpError, match="loss_scaler1"):
            # the good first entry is not loaded either: all are checked first
            amp.load_state_dict({"loss_scaler0": good, "loss_scaler1": bad})
        assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    for bad in (None, [1], "loss_scaler0", 3, {0: good}):
        with pytest.raises(AmpError, match=r"needs a dict|Unexpected key"):
            amp.load_state_dict(bad)
    # what torch.load may hand back: 0-d tensors, integral floats
    amp.load_state_dict({"loss_scaler0": {"loss_scale": torch.tensor(8.0),
                                          "unskipped": torch.tensor(3)},
                         "loss_scaler1": {"loss_scale": 4, "unskipped": 2.0}})
    assert amp.state_dict() == {"loss_scaler0": good,
                                "loss_scaler1": {"loss_scale": 4.0, "unskipped": 2}}


def _o2_step(zero, opt_cls=torch.optim.Adam):
    amp = Amp()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    o = opt_cls(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    before = [p.detach().clone() for p in amp.master_params(o)]
    with amp.scale_loss(m(x()).float().mean() * 1e-2, o) as scaled:
        scaled.backward()
    assert amp.loss_scale() == 65536.0  # no overflow: a real step
    if zero == "optimizer":
        o.zero_grad()
    elif zero == "model":
        m.zero_grad()
    o.step()
    return before, [p.detach().clone() for p in amp.master_params(o)], bits(m), o


def test_o2_grads_zeroed_between_scale_loss_and_step_as_apex():
    """Apex: ``optimizer.zero_grad()`` dropped the master grads (the step then changes
    nothing and leaves no optimizer state); ``model.zero_grad()`` clears only the float16
    model grads, the masters keep their unscaled grads and the step applies them."""
    before, after, _, o = _o2_step("optimizer")
    assert same(after, before) and not o.state
    _, ref_masters, ref_params, _ = _o2_step("none")
    _, masters, params, o = _o2_step("model")
    assert not same(ref_masters, before)
    assert same(masters, ref_masters) and same(params, ref_params)
