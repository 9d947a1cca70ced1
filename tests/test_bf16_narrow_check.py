"""bf16-mixed, nothing to unscale: the donated fused step checks the bf16 grads it widens.

The compute copy's grads are bfloat16; the fused kernel takes them widened to the float32
params. With no loss scale and one micro-batch there is nothing to divide, so no grad is
written before the update and the verdict is read from the grads before their conversion
(half the bytes), exactly: steps, skips and every record are bit for bit those of the
check on the widened grads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, mlp

import fmp
import fmp.loss_scale._unscale as unscale_mod

BAD_AT = {2: float("inf"), 3: float("nan")}


def _spy(mp, seen):
    real = unscale_mod.finite_after_unscale
    mp.setattr(unscale_mod, "finite_after_unscale",
               lambda leaves, dts, s: seen.append({x.dtype for x in leaves}) or real(
                   leaves, dts, s))


def _run(opt, mp, narrow=True, seen=None):
    if not narrow:  # the check of the widened grads themselves
        mp.setattr(unscale_mod.Unscaling, "_finite",
                   lambda self, g, like, out: fmp.all_finite(out))
    if seen is not None:
        _spy(mp, seen)
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
    _spy(monkeypatch, seen)
    x, y = blobs(16)
    apply_fn, params, _ = fmp.functional(mlp(seed=3))
    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(lambda p, a, b: F.cross_entropy(apply_fn(p, a).float(), b), opt,
                          "bf16-mixed", donate=True)
    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(initial=4.0))
    state, m = step(state, x, y)
    assert not seen and not bool(m["skipped"])


@pytest.mark.parametrize(("grad", "param", "max_overflows"), [
    (torch.bfloat16, torch.float32, False), (torch.float16, torch.float32, False),
    (torch.float32, torch.float64, False), (torch.bfloat16, torch.bfloat16, False),
    (torch.float32, torch.float16, True), (torch.float32, torch.bfloat16, True),
    (torch.float16, torch.bfloat16, False), (torch.bfloat16, torch.float16, True),
])
def test_verdict_read_before_the_conversion_is_that_of_the_converted(grad, param,
                                                                     max_overflows):
    """Widening or narrowing: a value that overflows the target dtype is caught."""
    for value in (torch.finfo(grad).max, 1.0, float("nan")):
        source = {"a": torch.tensor([0.5, value], dtype=grad),
                  "n": torch.ones(1, dtype=torch.int64)}
        converted = {"a": source["a"].to(param), "n": source["n"]}
        _, grad_scale, ok = fmp.NoOpLossScale().unscale_for_fused(converted,
                                                                   read_from=source)
        assert grad_scale is None
        assert bool(ok) == bool(fmp.all_finite(converted))
        if value == torch.finfo(grad).max:
            assert bool(ok) is not max_overflows


def test_nothing_to_divide_writes_no_grad():
    grads = {"w": torch.tensor([1.0, -2.5, 3.0]), "b": torch.tensor([0.5])}
    versions = {k: v._version for k, v in grads.items()}
    out, grad_scale, ok = fmp.NoOpLossScale().unscale_for_fused(grads)
    assert grad_scale is None and bool(ok) and out["w"] is grads["w"]
    assert {k: v._version for k, v in grads.items()} == versions
    bad = {"w": torch.tensor([1.0, float("nan")])}
    assert not bool(fmp.NoOpLossScale().unscale_for_fused(bad)[2])
