"""bf16-mixed, nothing to unscale: the donated fused step checks the bf16 grads it widens.

The compute copy's grads are bfloat16; the fused kernel takes them widened to the float32
params. With no loss scale and one micro-batch there is nothing to divide, so the verdict is
read from the narrow grads (half the bytes) and no grad is written before the update. The
widening is exact, so steps, skips and every record are bit for bit those of the check on
the widened grads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, mlp

import fmp
import fmp.step as fstep
from fmp._step_trees import widens_exactly

BAD_AT = {2: float("inf"), 3: float("nan")}


def _run(opt, monkeypatch=None, narrow=True, seen=None):
    if monkeypatch is not None:
        if not narrow:
            monkeypatch.setattr(fstep, "widens_exactly", lambda g, p: False)
        if seen is not None:
            real = fstep.all_finite
            monkeypatch.setattr(fstep, "all_finite",
                                lambda t: seen.append({x.dtype for x in t.values()})
                                or real(t))
    x, y = blobs(32)
    apply_fn, params, _ = fmp.functional(mlp(seed=3))

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    step = fmp.train_step(loss_fn, opt, "bf16-mixed", donate=True)
    state = fmp.TrainState.create(params, opt, fmp.NoOpLossScale())
    out = []
    for i in range(6):
        before = {k: v.clone() for k, v in state.params.items()}
        state, m = step(state, x, y, torch.tensor(BAD_AT.get(i, 1.0)))
        assert bool(m["skipped"]) == (i in BAD_AT)
        if i in BAD_AT:  # a skipped step: the params as they were, bit for bit
            assert_trees_bit_equal(state.params, before)
        out.append(({k: v.clone() for k, v in state.params.items()},
                    bool(m["skipped"]), m["loss"].clone()))
    return out, state


@pytest.mark.parametrize("opt", [lambda: fmp.optim.adamw(1e-2, weight_decay=0.1),
                                 lambda: fmp.optim.sgd(0.1, momentum=0.9)],
                         ids=["adamw", "sgd_momentum"])
def test_narrow_check_gives_the_same_steps_and_skips(opt, monkeypatch):
    seen: list[set] = []
    with monkeypatch.context() as mp:
        narrow, s_n = _run(opt(), mp, seen=seen)
    assert seen and all(d == {torch.bfloat16} for d in seen)  # read before the widening
    with monkeypatch.context() as mp:
        wide, s_w = _run(opt(), mp, narrow=False)
    for (pn, kn, ln), (pw, kw, lw) in zip(narrow, wide, strict=True):
        assert kn == kw
        assert_trees_bit_equal(pn, pw)
        assert_trees_bit_equal(ln, lw)
    assert_trees_bit_equal(s_n.opt_state, s_w.opt_state)
    assert int(s_n.skipped_total) == int(s_w.skipped_total) == len(BAD_AT)


def test_a_loss_scale_keeps_the_check_of_the_unscaled_grads(monkeypatch):
    """With a scale to divide by, the verdict is not read from the narrow grads."""
    seen: list[set] = []
    real = fstep.all_finite
    monkeypatch.setattr(fstep, "all_finite", lambda t: seen.append(1) or real(t))
    x, y = blobs(16)
    apply_fn, params, _ = fmp.functional(mlp(seed=3))
    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(lambda p, a, b: F.cross_entropy(apply_fn(p, a).float(), b), opt,
                          "bf16-mixed", donate=True)
    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(initial=4.0))
    state, m = step(state, x, y)
    assert not seen and not bool(m["skipped"])


@pytest.mark.parametrize(("grad", "param", "exact"), [
    (torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True),
    (torch.float32, torch.float64, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.float16, False), (torch.float32, torch.bfloat16, False),
    (torch.float16, torch.bfloat16, False), (torch.bfloat16, torch.float16, False),
])
def test_widens_exactly(grad, param, exact):
    g = {"a": torch.ones(2, dtype=grad), "n": torch.ones(1, dtype=torch.int64)}
    p = {"a": torch.ones(2, dtype=param), "n": torch.ones(1, dtype=torch.int64)}
    assert widens_exactly(g, p) is exact
    assert widens_exactly({"a": g["a"]}, {"a": p["a"], "b": p["a"]}) is False


def test_unscale_for_fused_writes_nothing_without_a_divisor():
    grads = {"w": torch.tensor([1.0, -2.5, 3.0]), "b": torch.tensor([0.5])}
    versions = {k: v._version for k, v in grads.items()}
    out, grad_scale, ok = fmp.NoOpLossScale().unscale_for_fused(grads)
    assert grad_scale is None and bool(ok)
    assert {k: v._version for k, v in grads.items()} == versions
    assert out["w"] is grads["w"]
    bad = {"w": torch.tensor([1.0, float("nan")])}
    assert not bool(fmp.NoOpLossScale().unscale_for_fused(bad)[2])
