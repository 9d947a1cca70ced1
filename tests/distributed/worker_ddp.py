"""Rank side of test_functional_ddp.py: the functional step and fmp.distributed on gloo."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import ScaleGrad, blobs, clone_tree, mlp

import fmp
import fmp.distributed as fd

STEPS = 6
INJECT = (2, 4)  # steps at which rank 1 (only) gets an inf gradient
N = 64


def _setup(policy: str, loss_scale=None, opt=None):
    apply_fn, params, _ = fmp.functional(mlp(seed=0))
    opt = opt or fmp.optim.adamw(1e-2)

    def loss_fn(p, x, y, factor):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), factor).float(), y)

    params = fmp.get_policy(policy).cast_to_param(clone_tree(params))
    return loss_fn, opt, fmp.TrainState.create(params, opt, loss_scale)


def _train(rank, world, policy, inject, process_group, loss_scale=None):
    """Train STEPS steps; this rank's shard of the batch, or all of it when single."""
    loss_fn, opt, state = _setup(policy, loss_scale)
    step = fmp.train_step(loss_fn, opt, policy, process_group=process_group)
    x, y = blobs(N)
    if process_group is not None:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    trace = []
    for i in range(STEPS):
        bad = rank == 1 and i in inject
        factor = torch.tensor(float("inf") if bad else 1.0)
        state, m = step(state, x, y, factor)
        trace.append({k: v.clone() for k, v in m.items()}
                     | {"params": clone_tree(state.params)})
    return {"trace": trace, "params": state.params, "skipped_total": state.skipped_total,
            "loss_scale": state.loss_scale.loss_scale}


def equal_to_single(rank, world):
    return {"dp": _train(rank, world, "fp32", (), "default"),
            "single": _train(rank, world, "fp32", (), None)}


def inf_on_one_rank(rank, world):
    return _train(rank, world, "bf16-mixed", INJECT, "default",
                  fmp.DynamicLossScale.create(initial=2.0**10, period=2))


def all_finite_verdicts(rank, world):
    ok = {"a": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    cases = {
        "all_ok": ok,
        "inf_on_1": {"a": torch.tensor([1.0, float("inf") if rank == 1 else 2.0]),
                     "b": ok["b"]},
        "nan_on_0": {"a": torch.ones(3), "b": torch.tensor([float("nan") if rank == 0 else 1.0],
                                                           dtype=torch.bfloat16)},
        # shards may differ across ranks: only the verdict is reduced
        "ragged": [torch.ones(rank + 1)],
        "no_float_leaves_on_1": {"a": torch.ones(2)} if rank == 0 else {"n": torch.arange(3)},
    }
    out = {}
    for k, tree in cases.items():
        v = fd.all_finite(tree)
        out[k] = (v.dtype, tuple(v.shape), bool(v))
    return out


def _counted(fn):
    calls = []
    orig = fd._all_reduce

    def spy(t, op, pg):
        calls.append((t.dtype, t.numel()))
        return orig(t, op, pg)

    fd._all_reduce = spy
    try:
        return fn(), calls
    finally:
        fd._all_reduce = orig


def all_reduce_results(rank, world):
    s = float(rank + 1)
    tree = {"w": [torch.full((5, 3), s) for _ in range(40)],
            "h": torch.full((7,), s, dtype=torch.bfloat16),
            "n": torch.arange(4) * (rank + 1),
            "none": None,
            "strided": torch.full((4, 6), s).t()}
    before = clone_tree(tree)
    mean, mean_calls = _counted(lambda: fd.all_reduce_grads(tree))
    summ, _ = _counted(lambda: fd.all_reduce_grads(tree, op="sum"))
    small, small_calls = _counted(lambda: fd.all_reduce_grads(tree, bucket_mb=200 * 4 / 1e6))
    f32, f32_calls = _counted(lambda: fd.all_reduce_grads(tree, reduce_dtype="f32"))
    return {"tree": tree, "before": before, "mean": mean, "sum": summ, "small": small,
            "f32": f32, "mean_calls": mean_calls, "small_calls": small_calls,
            "f32_calls": f32_calls}


def mismatched_trees(rank, world):
    out = {}
    cases = {
        "shape": {"a": torch.ones(3), "b": torch.ones(4 if rank == 0 else 5)},
        "extra_leaf": {"a": torch.ones(3)} | ({"c": torch.ones(1)} if rank == 1 else {}),
        "dtype": {"a": torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float16)},
    }
    for k, tree in cases.items():
        try:
            fd.all_reduce_grads(tree)
            out[k] = "no error"
        except ValueError as e:
            out[k] = str(e)
    # a mismatch leaves the group usable: the next (matching) reduction works
    out["after"] = fd.all_reduce_grads({"a": torch.full((2,), float(rank))}, op="sum")["a"]
    # once checked, a signature is not gathered again
    calls = []
    orig = torch.distributed.all_gather_object
    torch.distributed.all_gather_object = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    try:
        for _ in range(3):
            fd.all_reduce_grads({"z": torch.ones(2)})
    finally:
        torch.distributed.all_gather_object = orig
    out["gathers"] = len(calls)
    return out


def train_step_rejects_bad_group(rank, world):
    loss_fn, opt, _ = _setup("fp32")
    try:
        fmp.train_step(loss_fn, opt, process_group="defualt")
    except TypeError as e:
        return str(e)
    return "no error"


def compiled_step_equals_eager(rank, world):
    """torch.compile(fullgraph=True) traces the data-parallel step (functional collectives),
    as one graph and as fmp.compile's two (the update graph holds the collectives)."""
    loss_fn, opt, state = _setup("bf16-mixed", fmp.DynamicLossScale.create(), fmp.optim.sgd(0.1))
    step = fmp.train_step(loss_fn, opt, "bf16-mixed", process_group="default")
    x, y = blobs(N)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    two_graphs = fmp.compile(step, backend="aot_eager")
    out = {}
    for bad in (False, True):  # one trace: the factor is a tensor input
        factor = torch.tensor(float("inf") if bad and rank == 1 else 1.0)
        eager = step(state, x, y, factor)  # (the first eager call checks the tree)
        out[bad] = {"eager": eager, "compiled": compiled(state, x, y, factor),
                    "fmp.compile": two_graphs(state, x, y, factor)}
    return out


SCENARIOS = {"equal_to_single": equal_to_single, "inf_on_one_rank": inf_on_one_rank,
             "all_finite_verdicts": all_finite_verdicts,
             "all_reduce_results": all_reduce_results, "mismatched_trees": mismatched_trees,
             "train_step_rejects_bad_group": train_step_rejects_bad_group}
SLOW_SCENARIOS = {"compiled_step_equals_eager": compiled_step_equals_eager}
