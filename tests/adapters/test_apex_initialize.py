"""initialize: presets, overrides, shapes, model casting, and the clear errors."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from adapters import apex
from adapters.apex import amp as amp_module
from adapters.apex.amp import Amp, AmpError

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def test_both_import_styles_and_module_functions():
    assert apex.amp is amp_module
    assert amp_module.initialize.__self__ is amp_module.default_amp()
    for name in ("initialize", "scale_loss", "autocast", "master_params", "state_dict",
                 "load_state_dict", "disable_casts", "half_function", "float_function",
                 "promote_function", "register_half_function", "register_float_function",
                 "register_promote_function", "last_step_skipped"):
        assert callable(getattr(amp_module, name))
        assert callable(getattr(Amp, name))


def test_signature_and_defaults_are_apexs():
    sig = inspect.signature(Amp.initialize)
    expected = dict(optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
                    patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
                    loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
                    min_loss_scale=None, max_loss_scale=2.0**24)
    assert list(sig.parameters)[1:] == ["models", *expected]
    for k, v in expected.items():
        assert sig.parameters[k].default == v
    sig = inspect.signature(Amp.scale_loss)
    assert list(sig.parameters)[1:] == ["loss", "optimizers", "loss_id", "model",
                                        "delay_unscale", "delay_overflow_check"]


@pytest.mark.parametrize("level,wdtype,bndtype,masters,scale", [
    ("O0", F32, F32, False, 1.0), ("O1", F32, F32, False, 65536.0),
    ("O2", F16, F32, True, 65536.0), ("O3", F16, F16, False, 1.0),
    ("O4", F32, F32, False, 1.0), ("O5", BF16, F32, True, 1.0),
])
def test_presets(level, wdtype, bndtype, masters, scale):
    amp = Amp()
    m = net()
    o = sgd(m)
    m2, o2 = amp.initialize(m, o, opt_level=level, verbosity=0)
    assert m2 is m and o2 is o
    assert m[0].weight.dtype == wdtype and m[1].weight.dtype == bndtype
    assert m[1].running_mean.dtype == bndtype
    masters_dtypes = {p.dtype for p in amp.master_params(o)}
    assert masters_dtypes == ({F32} if masters or wdtype == F32 else {wdtype, bndtype})
    assert amp.loss_scale() == scale
    assert amp.loss_scalers[0].dynamic == (scale == 65536.0)
    out = m(torch.randn(5, 4))
    # [amp14a] O1/O4: the output of the last half op stays half, as in Apex
    assert out.dtype == {"O1": F16, "O4": BF16}.get(level, F32)
    assert {v.dtype for v in m.state_dict().values() if v.is_floating_point()} == {F32}


def test_overrides_after_preset():
    amp = Amp()
    m = net()
    amp.initialize(m, opt_level="O2", keep_batchnorm_fp32="False", loss_scale=128,
                   cast_model_outputs=F16, verbosity=0)
    assert m[1].weight.dtype == F16
    assert amp.properties.loss_scale == 128.0 and amp.loss_scale() == 128.0
    assert m(torch.randn(5, 4)).dtype == F16
    amp = Amp()
    m = net()
    amp.initialize(m, opt_level="O3", keep_batchnorm_fp32=True, verbosity=0,
                   cast_model_type=BF16, loss_scale="dynamic")
    assert m[0].weight.dtype == BF16 and m[1].weight.dtype == F32
    assert amp.loss_scalers[0].dynamic
    amp = Amp()
    amp.initialize(net(), opt_level="O1", max_loss_scale=2.0**10, verbosity=0)
    assert amp.loss_scale() == 1024.0


def test_shapes_are_returned_as_given():
    amp = Amp()
    ms = [net(), net()]
    os_ = [sgd(ms[0]), sgd(ms[1])]
    r = amp.initialize(ms, os_, verbosity=0)
    assert isinstance(r, tuple) and r[0] == ms and r[1] == os_ and isinstance(r[0], list)
    m = net()
    assert Amp().initialize(m, verbosity=0) is m
    assert Amp().initialize([m2 := net()], verbosity=0) == [m2]


def test_enabled_false_is_a_pass_through():
    amp = Amp()
    m = net()
    o = sgd(m)
    before = copy.deepcopy(m.state_dict())
    assert amp.initialize(m, o, enabled=False, opt_level="O2") == (m, o)
    assert m[0].weight.dtype == F32 and "forward" not in m.__dict__
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    loss = m(torch.randn(5, 4)).sum()
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss
    with amp.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == F32


def test_o1_casts_nothing_and_autocasts_the_forward():
    amp = Amp()
    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    seen = []
    m[0].register_forward_hook(lambda mod, i, out: seen.append(out.dtype))
    amp2 = Amp()  # [amp14a] first: the O1 casts of `amp` below stay on in this thread
    m2 = torch.nn.Linear(4, 3)
    amp2.initialize(m2, opt_level="O1", patch_torch_functions=False, verbosity=0)
    assert m2(torch.randn(2, 4)).dtype == F32 and "forward" not in m2.__dict__
    amp.initialize(m, opt_level="O1", verbosity=0)
    assert m[0].weight.dtype == F32
    out = m(torch.randn(2, 4))  # no amp.autocast(): the O1 casts are on after initialize
    assert seen == [F16] and out.dtype == F16  # [amp14a] output stays half, as in Apex


def test_o2_forward_casts_inputs_and_deepcopy_keeps_working():
    amp = Amp()
    m = net()
    amp.initialize(m, opt_level="O2", verbosity=0)
    x = {"a": torch.randn(5, 4, dtype=torch.float64)}

    class Wrap(torch.nn.Module):
        def forward(self, d, scale=1.0):
            return {"y": d["a"] * scale, "dtype": str(d["a"].dtype)}

    w = Wrap()
    Amp().initialize(w, opt_level="O2", verbosity=0)
    out = w(x, scale=torch.tensor(2.0))
    assert out["dtype"] == "torch.float16" and out["y"].dtype == F32
    c = copy.deepcopy(m)
    assert c.forward.module is c
    assert c(torch.randn(5, 4)).dtype == F32


@pytest.mark.parametrize("kwargs,match", [
    (dict(opt_level="O9"), "valid opt levels are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'"),
    (dict(opt_level="o1"), "did you mean 'O1'"),
    (dict(opt_level="01"), "letter O, not the number zero"),
    (dict(opt_level="O1", master_weights=True), "master_weights make no sense"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32 should be None"),
    (dict(opt_level="O1", cast_model_type=F16), "model weights should stay float32"),
    (dict(opt_level="O4", cast_model_type=BF16), "model weights should stay float32"),
    (dict(opt_level="O2", patch_torch_functions=True), "only valid with opt_level 'O1'"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "must be a boolean, the string"),
    (dict(opt_level="O2", loss_scale="huge"), "'dynamic' or a positive finite number"),
    (dict(opt_level="O2", loss_scale=-1), "'dynamic' or a positive finite number"),
    (dict(opt_level="O2", cast_model_type="int8"), "is not a dtype"),
    (dict(num_losses=0), "num_losses must be an int >= 1"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "greater than max_loss_scale"),
])
def test_nonsense_is_rejected(kwargs, match):
    with pytest.raises(AmpError, match=match):
        Amp().initialize(net(), **kwargs, verbosity=0)
    # AmpError is both what Apex raised and fmp's convention
    assert issubclass(AmpError, RuntimeError) and issubclass(AmpError, ValueError)


def test_o1_accepts_cast_model_type_float32_or_false():
    for v in (F32, False):
        m = net()
        Amp().initialize(m, opt_level="O1", cast_model_type=v, verbosity=0)
        assert m[0].weight.dtype == F32


def test_parallel_wrappers_must_come_after():
    with pytest.raises(AmpError, match="wrap after initialize"):
        Amp().initialize(torch.nn.DataParallel(net()), verbosity=0)


def test_optimizer_initialized_twice():
    m = net()
    o = sgd(m)
    Amp().initialize(m, o, verbosity=0)
    with pytest.raises(AmpError, match="initialize twice"):
        Amp().initialize(net(), o, verbosity=0)
    with pytest.raises(AmpError, match="appears twice"):
        m2 = net()
        o2 = sgd(m2)
        Amp().initialize(m2, [o2, o2], verbosity=0)


def test_bad_model_or_optimizer_types():
    with pytest.raises(AmpError, match="models must be"):
        Amp().initialize("model", verbosity=0)
    with pytest.raises(AmpError, match="optimizers must be"):
        Amp().initialize(net(), object(), verbosity=0)


def test_calls_before_initialize():
    amp = Amp()
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(AmpError, match=r"before amp\.initialize"), \
            amp.scale_loss(loss, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)):
        pass
    with pytest.raises(AmpError, match=r"before amp\.initialize"):
        amp.autocast()


def test_step_closure_and_loss_id_and_foreign_optimizer():
    amp = Amp()
    m = net()
    o = sgd(m)
    amp.initialize(m, o, num_losses=2, verbosity=0)
    with pytest.raises(AmpError, match="closure"):
        o.step(lambda: 0.0)
    loss = m(torch.randn(5, 4)).sum()
    with pytest.raises(AmpError, match=r"loss_id=2 is out of range.*num_losses=2"), \
            amp.scale_loss(loss, o, loss_id=2):
        pass
    other = sgd(net())
    with pytest.raises(AmpError, match="not passed through"), amp.scale_loss(loss, other):
        pass


def test_initialize_again_replaces_state():
    amp = Amp()
    m = net()
    amp.initialize(m, sgd(m), opt_level="O1", verbosity=0)
    m2 = net()
    amp.initialize(m2, sgd(m2), opt_level="O0", num_losses=3, verbosity=0)
    assert len(amp.state_dict()) == 3 and amp.properties.opt_level == "O0"
