"""fmp.cuda_graph: a train step captured once and replayed, equal to the step it captures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp


def _make(donate, device="cuda", compute_copy=True):
    net = mlp(seed=0).to(device)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.adamw(1e-2)

    def loss_fn(p, x, y, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), f).float(), y)

    step = fmp.train_step(loss_fn, opt, "fp16-mixed", donate=donate,
                          compute_copy=compute_copy)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**12, period=3))
    x, y = (t.to(device) for t in blobs(64))
    return step, state, x, y


def _factor(i, inf_at=(2,)):
    return torch.full((), float("inf") if i in inf_at else 1.0, device="cuda")


def test_refuses_cpu_tensors_and_a_bad_warmup():
    step, state, x, y = _make(False, device="cpu")
    with pytest.raises(ValueError, match=r"state\.params\['0\.bias'\] is on cpu"):
        fmp.cuda_graph(step, state, x, y, torch.ones(()))
    with pytest.raises(ValueError, match="warmup must be an int >= 1, got 0"):
        fmp.cuda_graph(step, state, x, y, torch.ones(()), warmup=0)


@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("compute_copy", [True, False])
def test_replays_equal_the_eager_step_bit_for_bit(donate, compute_copy):
    """The same kernels replayed: every state equal to the eager step's, skips included;
    the warm-up ran on a copy, so the state starts where it was."""
    step, state, x, y = _make(donate, compute_copy=compute_copy)
    ref = clone_tree(state)
    graphed = fmp.cuda_graph(step, state, x, y, _factor(0), warmup=2)
    assert int(graphed.state.step) == 0
    s = graphed.state
    for i in range(6):
        xi, yi = x.roll(i, 0), y.roll(i, 0)
        before = clone_tree(s.params)
        ref, ref_m = step(ref, xi, yi, _factor(i))
        s, m = graphed(s, xi, yi, _factor(i))
        assert s is graphed.state
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        assert_trees_bit_equal(m["loss"], ref_m["loss"])
        if i == 2:
            assert_trees_bit_equal(s.params, before)
        assert_trees_bit_equal(s.params, ref.params)
        assert_trees_bit_equal(s.opt_state, ref.opt_state)
        assert_trees_bit_equal(s.loss_scale, ref.loss_scale)
        assert int(s.step) == i + 1
    if compute_copy:
        assert_trees_bit_equal(s.compute_params,
                               fmp.get_policy("fp16-mixed").cast_to_compute(s.params))


@pytest.mark.cuda
@pytest.mark.slow
def test_fmp_compiled_step_in_a_graph_and_another_state_loaded():
    step, state, x, y = _make(True)
    eager, ref, _, _ = _make(True)
    graphed = fmp.cuda_graph(fmp.compile(step), state, x, y, _factor(0), warmup=3)
    s = graphed.state
    for i in range(4):
        ref, ref_m = eager(ref, x, y, _factor(i))
        s, m = graphed(s, x, y, _factor(i))
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        torch.testing.assert_close(s.params, ref.params, rtol=1e-3, atol=1e-4)
    # a state from elsewhere (here the eager one, without its copy) is copied in
    other = clone_tree(ref)._replace(compute_params=None)
    ref, ref_m = eager(ref, x, y, _factor(9))
    s, m = graphed(other, x, y, _factor(9))
    torch.testing.assert_close(s.params, ref.params, rtol=1e-3, atol=1e-4)
    assert_trees_bit_equal(s.compute_params,
                           fmp.get_policy("fp16-mixed").cast_to_compute(s.params))


@pytest.mark.cuda
def test_warmup_trains_when_asked_and_bad_batches_are_named():
    step, state, x, y = _make(True)
    graphed = fmp.cuda_graph(step, state, x, y, _factor(0), warmup=2, warmup_trains=True)
    assert int(graphed.state.step) == 2
    with pytest.raises(ValueError, match=r"batch leaf 0 is torch.float32 \(32, 8\); the "
                                         r"graph was captured with torch.float32 \(64, 8\)"):
        graphed(graphed.state, x[:32], y[:32], _factor(0))


class _Replay:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: replay runs ``fn``."""

    def __init__(self, fn) -> None:
        self.replay = fn


def test_the_state_consumed_by_a_training_warm_up_is_not_loaded_again():
    """cuda_graph(..., warmup_trains=True) consumes the state it is given: its warm-up
    wrote the params in place but the counters are new tensors, so the old state object
    is half trained. Passed again (README's loop: ``state, m = graphed(state, ...)``), it
    must continue from the graph's state, not reset the counters to the old ones (on an
    H100 that restarted Adam's bias correction after the warm-up: a 1% different loss)."""
    w = torch.ones(3)
    consumed = {"w": w, "count": torch.tensor(0)}       # as the caller still holds it
    graph_state = {"w": w, "count": torch.tensor(3)}    # after three warm-up steps
    out = {"w": w, "count": torch.tensor(0)}            # the captured step's result

    def replay():  # what the captured step does: count + 1 into its output
        out["count"].copy_(graph_state["count"] + 1)

    g = fmp.GraphedStep(_Replay(replay), graph_state, (), out, {}, consumed=consumed)
    s, _ = g(consumed)
    assert s is graph_state and int(s["count"]) == 4    # not reset to 0 before the step
    s, _ = g(s)
    assert int(s["count"]) == 5
    other = {"w": torch.full((3,), 2.0), "count": torch.tensor(7)}
    s, _ = g(other)                                     # any other state is copied in
    assert int(s["count"]) == 8 and torch.equal(s["w"], torch.full((3,), 2.0))
    # without a consumed state (warmup_trains=False) a state passed in is always loaded
    graph_state["count"].fill_(3)
    g = fmp.GraphedStep(_Replay(replay), graph_state, (), out, {})
    s, _ = g(consumed)
    assert int(s["count"]) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("update", ["eager", "compiled"])
def test_warm_up_that_trains_then_the_callers_own_state_continues_exactly(update):
    """The README loop after a training warm-up, with the donated step whose fused
    update writes params and moments in place and makes a new count: the graph keeps
    the eager step's trajectory (count, moments, params) step for step."""
    step, state, x, y = _make(True)
    ref_step, ref, _, _ = _make(True)
    stepper = fmp.compile(step, update=update)
    graphed = fmp.cuda_graph(stepper, state, x, y, _factor(9), warmup=3, warmup_trains=True)
    for _ in range(3):
        ref, _ = ref_step(ref, x, y, _factor(9))
    for i in range(4):
        ref, ref_m = ref_step(ref, x, y, _factor(i))
        state, m = graphed(state, x, y, _factor(i))
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        assert int(state.opt_state.count) == int(ref.opt_state.count) == 3 + i + (i < 2)
        torch.testing.assert_close(state.params, ref.params, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(state.opt_state, ref.opt_state, rtol=1e-3, atol=1e-4)
