"""Behaviour Apex's own L0 amp tests rely on (issues 14/15), checked on CPU where possible."""

from __future__ import annotations

import math
import unittest

import pytest
import torch

from adapters.apex import amp, amp_C
from adapters.apex.amp import Amp, _amp_state
from adapters.apex.amp._errors import AmpError
from adapters.apex.optimizers import FusedSGD
from adapters.apex.parallel.LARC import LARC


def _init(opt_level: str = "O2", **kw):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (*amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kw),)


# (b) ---------------------------------------------------------------------------------
def test_allow_incoming_model_not_fp32_is_settable_and_half_model_accepted():
    assert _amp_state.allow_incoming_model_not_fp32 is False
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        assert _amp_state.allow_incoming_model_not_fp32 is True
        model = torch.nn.Linear(2, 2).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        assert model.weight.dtype == torch.float16
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    assert _amp_state.allow_incoming_model_not_fp32 is False
    with pytest.raises(AmpError, match="must be a bool"):
        _amp_state.allow_incoming_model_not_fp32 = "yes"


def test_other_amp_state_writes_still_raise():
    _init()
    with pytest.raises(AmpError, match=r"read-only.*'verbosity'"):
        _amp_state.verbosity = 2
    with pytest.raises(AmpError, match=r"read-only.*'dynamic'"):
        _amp_state.loss_scalers[0].dynamic = False


@pytest.mark.parametrize("opt_level", ["O0", "O2"])  # static 1.0 and dynamic 65536
def test_set_loss_scale_takes_effect(opt_level):
    model, opt = _init(opt_level)
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    assert _amp_state.loss_scalers[0].loss_scale() == 4.0
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 4.0
    x = torch.ones(2, 3, dtype=next(model.parameters()).dtype)
    loss = model(x).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(4.0 * loss.item(), rel=1e-3)
        scaled.backward()
    # the grads the step sees are unscaled by that same 4.0
    assert amp.master_params(opt).__next__().grad[0].tolist() == pytest.approx(
        [2.0, 2.0, 2.0], rel=1e-3)


def test_set_unskipped_and_bad_values():
    _init("O2")
    s = _amp_state.loss_scalers[0]
    s._unskipped = 7
    assert s._unskipped == 7 and s.loss_scale() == 65536.0
    with pytest.raises(ValueError, match="positive finite"):
        s._loss_scale = -1.0
    with pytest.raises(ValueError, match="non-negative int"):
        s._unskipped = 1.5
    assert s.loss_scale() == 65536.0 and s._unskipped == 7


# (c) ---------------------------------------------------------------------------------
def test_fused_sgd_per_group_lr_without_default():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([{"params": [a], "lr": 0.25}, {"params": [b], "lr": 0.5}], momentum=0.125)
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    assert a.tolist() == [0.75, 0.75] and b.tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    with pytest.raises(ValueError, match="lr is required"):
        FusedSGD([a])
    with pytest.raises(ValueError, match="lr is required"):
        FusedSGD([{"params": [a], "lr": 0.1}, {"params": [b]}])


# (d) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_larc_through_initialize_scale_loss_step(opt_level):
    def run(use_amp):
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        opt = LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}],
                                   momentum=0.125))
        if use_amp:
            model, opt2 = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
            assert opt2 is opt
        x = torch.ones(1, 2, dtype=model.weight.dtype)
        for _ in range(2):
            opt.zero_grad()
            loss = model(x).float().sum() * 0.125  # no fp16 overflow at 2**16
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
        return [p.float() for p in amp.master_params(opt)] if use_amp else [model.weight]

    ref, got = run(False), run(True)
    tol = 0 if opt_level == "O0" else 1e-3
    torch.testing.assert_close(got[0], ref[0].detach(), atol=tol, rtol=tol)
    assert not torch.equal(ref[0].detach(), torch.tensor([[1.0, 2.0]]))
    assert not amp.last_step_skipped()


# (e) ---------------------------------------------------------------------------------
def test_scale_check_overflow():
    buf = torch.zeros(1, dtype=torch.int)
    inp = torch.full((4, 5), 128.0, dtype=torch.float16)
    out = torch.full((4, 5), 3.0)
    amp_C.scale_check_overflow(inp, 1.0 / 128, buf, out)
    assert torch.equal(out, torch.ones(4, 5)) and buf.item() == 0
    inp[2, 3] = float("nan")
    amp_C.scale_check_overflow(inp, 1.0 / 128, buf, out)
    assert buf.item() == 1
    same = torch.full((3,), 4.0)
    buf.zero_()
    amp_C.scale_check_overflow(same, 0.5, buf, same)
    assert same.tolist() == [2.0, 2.0, 2.0] and buf.item() == 0
    with pytest.raises(ValueError, match="float32"):
        amp_C.scale_check_overflow(same, 0.5, buf, torch.empty(3, dtype=torch.float16))


def test_testing_common_utils(monkeypatch):
    from adapters.apex.testing import common_utils

    @common_utils.skipIfRocm
    def f(x):
        return x + 1

    assert f(1) == 2
    monkeypatch.setattr(common_utils, "TEST_WITH_ROCM", True)
    with pytest.raises(unittest.SkipTest):
        f(1)


# (g) ---------------------------------------------------------------------------------
def test_update_scale_hysteresis_backoff_flushes_subnormal_to_zero():
    s = torch.tensor([2.0**-125], dtype=torch.float32)
    g = torch.tensor([0], dtype=torch.int32)
    h = torch.tensor([1], dtype=torch.int32)
    inf = torch.tensor([1.0])
    amp_C.update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 10, 1)
    assert s.item() == 2.0**-126  # smallest normal: kept
    amp_C.update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 10, 1)
    assert s.item() == 0.0  # Apex's kernel (fast math) gives 0, not a subnormal
    assert h.item() == -1
    # 0 then never grows back
    for _ in range(10):
        amp_C.update_scale_hysteresis(s, g, h, torch.tensor([0.0]), 2.0, 0.5, 10, 1)
    assert s.item() == 0.0 and h.item() == 1


def test_update_scale_hysteresis_trajectory():
    s = torch.tensor([65536.0])
    g = torch.tensor([0], dtype=torch.int32)
    h = torch.tensor([3], dtype=torch.int32)
    inf, ok = torch.tensor([1.0]), torch.tensor([0.0])
    for _ in range(2):
        amp_C.update_scale_hysteresis(s, g, h, inf, 2.0, 0.25, 4, 3)
    assert s.item() == 65536.0
    for _ in range(3):
        amp_C.update_scale_hysteresis(s, g, h, ok, 2.0, 0.25, 4, 3)
    assert s.item() == 65536.0 and g.item() == 3 and h.item() == 3
    for _ in range(5):
        amp_C.update_scale_hysteresis(s, g, h, inf, 2.0, 0.25, 4, 3)
    assert s.item() == 65536.0 * 0.25**3
    assert not math.isnan(s.item())


def test_amp_instance_unaffected_by_default_state_writes():
    a = Amp()
    model = torch.nn.Linear(2, 2)
    a.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O2",
                 verbosity=0)
    _init("O2")
    _amp_state.loss_scalers[0]._loss_scale = 8.0
    assert a.loss_scale() == 65536.0


# (f) ---------------------------------------------------------------------------------
F16_ = torch.float16


def _overflowing_step(a, model, opt):
    opt.zero_grad()
    with a.scale_loss(model(torch.ones(1, 3, dtype=F16_)).float().sum(), opt) as scaled:
        scaled.backward()
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()


def test_latest_initialize_scalers_serve_earlier_optimizers_as_apex():
    """Apex's test_checkpointing.test_restoring: the reference keeps training after a
    restored copy was initialized; both must then see the same (fresh) loss scale."""
    a = Amp()
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    ref, ref_opt = a.initialize(ref, ref_opt, opt_level="O2", num_losses=2, verbosity=0)
    _overflowing_step(a, ref, ref_opt)
    assert a.loss_scale(0) == 32768.0
    restored = torch.nn.Linear(3, 1)
    r_opt = torch.optim.SGD(restored.parameters(), lr=1e-3)
    restored, r_opt = a.initialize(restored, r_opt, opt_level="O2", num_losses=2,
                                   verbosity=0)
    restored.load_state_dict(ref.state_dict())
    r_opt.load_state_dict(ref_opt.state_dict())
    x = torch.ones(1, 3, dtype=F16_)
    seen = []
    for model, opt, loss_id in ((ref, ref_opt, 0), (restored, r_opt, 1)):
        opt.zero_grad()
        loss = model(x).float().sum()
        with a.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            seen.append(scaled.item() / loss.item())
            scaled.backward()
        opt.step()
    assert seen == [65536.0, 65536.0]
    for (k, v), (k2, v2) in zip(ref.state_dict().items(), restored.state_dict().items(),
                                strict=True):
        assert k == k2 and torch.equal(v, v2)
