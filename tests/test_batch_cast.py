"""Batch casts under mixed policies: cast_batch leaves chosen leaves uncast; overflow warns."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import mlp


def _regression(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = 70000.0 + 1000.0 * torch.randn(n, 2, generator=g)  # above float16's max, 65504
    return x, y


def _setup(**kw):
    apply_fn, params, _ = fmp.functional(mlp())
    seen = {}

    def loss_fn(p, x, y):
        seen["x"], seen["y"] = x.dtype, y.dtype
        x = x.to(p["0.weight"].dtype)  # uncast under cast_batch=False: the loss_fn's job
        return F.mse_loss(apply_fn(p, x).float(), y.float()) * 1e-6

    opt = fmp.optim.sgd(1e-6)
    step = fmp.train_step(loss_fn, opt, "fp16-mixed", **kw)
    return step, fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(initial=1.0)), seen


def test_overflowing_cast_warns_once_naming_the_leaf():
    step, state, _ = _setup()
    x, y = _regression()
    with pytest.warns(RuntimeWarning, match=r"batch arg 1 \(torch.float32\).*inf when cast.*"
                                            r"torch.float16.*cast_batch"):
        state, m = step(state, x, y)
    assert bool(m["skipped"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(state, x, y)  # once only: later calls read nothing on the host


def test_cast_batch_keeps_chosen_leaves_in_their_dtype_and_trains():
    step, state, seen = _setup(cast_batch=(True, False))
    x, y = _regression()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            state, m = step(state, x, y)
            assert not bool(m["skipped"])
    assert seen == {"x": torch.float16, "y": torch.float32}
    step_none, state2, seen2 = _setup(cast_batch=False)
    step_none(state2, x, y)
    assert seen2 == {"x": torch.float32, "y": torch.float32}


def test_cast_batch_errors():
    with pytest.raises(ValueError, match=r"cast_batch must be True, False or a sequence.*'no'"):
        _setup(cast_batch="no")
    step, state, _ = _setup(cast_batch=(True,))
    with pytest.raises(ValueError, match="cast_batch has 1 entries but the step got 2"):
        step(state, *_regression())


def test_value_and_grad_cast_batch():
    vg = fmp.value_and_grad(lambda p, x, y: ((p["w"] * x).float() - y).square().mean(),
                            "fp16-mixed", cast_batch=[True, False])
    y = torch.full((3,), 70000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, _, finite = vg({"w": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3), y)
    assert bool(finite) and float(loss) == pytest.approx(69999.0 ** 2)
    with pytest.warns(RuntimeWarning, match="fmp.value_and_grad: batch arg 1"):
        fmp.value_and_grad(lambda p, x, y: (p["w"] * x * y).sum(), "fp16-mixed")(
            {"w": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3), y)
