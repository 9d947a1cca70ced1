"""The step's compute-dtype copy of the params: bit-identical to casting, never stale."""

from __future__ import annotations

import io

import optree
import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmp

INF_AT = (2, 3)


def _setup(opt, donate=False, accumulate=1, policy="fp16-mixed", compute_copy=True):
    x, y = blobs(32)
    apply_fn, params, _ = fmp.functional(mlp(seed=1))

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    step = fmp.train_step(loss_fn, opt, policy, accumulate=accumulate, donate=donate,
                          compute_copy=compute_copy)
    ls = fmp.DynamicLossScale.create(initial=2.0**10, period=2)
    return step, fmp.TrainState.create(params, opt, ls), (x, y)


def _factor(i):
    return torch.tensor(float("inf") if i in INF_AT else 1.0)


OPTS = {"adamw": lambda: fmp.optim.adamw(1e-2, weight_decay=0.1),
        "sgd_momentum": lambda: fmp.optim.sgd(0.1, momentum=0.9)}


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_copy_gives_the_same_bits_as_casting_every_step(opt, donate, accumulate):
    step_c, s_c, (x, y) = _setup(OPTS[opt](), donate, accumulate)
    step_r, s_r, _ = _setup(OPTS[opt](), donate, accumulate, compute_copy=False)
    pol = fmp.get_policy("fp16-mixed")
    for i in range(6):
        before = clone_tree(s_c.compute_params)
        s_c, m_c = step_c(s_c, x, y, _factor(i))
        s_r, m_r = step_r(s_r, x, y, _factor(i))
        assert bool(m_c["skipped"]) == bool(m_r["skipped"]) == (i in INF_AT)
        assert_trees_bit_equal(m_c["loss"], m_r["loss"])
        assert_trees_bit_equal(s_c.params, s_r.params)
        assert_trees_bit_equal(s_c.opt_state, s_r.opt_state)
        assert_trees_bit_equal(s_c.loss_scale, s_r.loss_scale)
        # the copy the update wrote is exactly the cast of the params it kept
        assert_trees_bit_equal(s_c.compute_params, pol.cast_to_compute(s_c.params))
        if i in INF_AT and before is not None:
            assert_trees_bit_equal(s_c.compute_params, before)
        assert s_r.compute_params is None


def test_the_forward_reads_the_copy():
    step, state, (x, y) = _setup(fmp.optim.sgd(0.1))
    seen = []
    apply_fn, _, _ = fmp.functional(mlp(seed=1))

    def loss_fn(p, a, b):
        seen.append({k: v.untyped_storage().data_ptr() for k, v in p.items()})
        return F.cross_entropy(apply_fn(p, a).float(), b)

    step = fmp.train_step(loss_fn, fmp.optim.sgd(0.1), "fp16-mixed")
    state, _ = step(state, x, y)
    copy = state.compute_params
    assert {v.dtype for v in copy.values()} == {torch.float16}
    state, _ = step(state, x, y)
    assert seen[1] == {k: v.untyped_storage().data_ptr() for k, v in copy.items()}


def _reference_after(state, x, y, donate=False, opt=None):
    """One step on ``state`` with casting (no copy): what the copy step must give."""
    opt = opt or fmp.optim.sgd(0.1, momentum=0.9)
    step_r, _, _ = _setup(opt, donate=donate, compute_copy=False)
    return step_r(clone_tree(state._replace(compute_params=None)), x, y, _factor(0))[0]


EDITS = {
    "params replaced": lambda s: s._replace(params={k: v * 0.5 for k, v in s.params.items()}),
    "params edited in place": lambda s: (
        [v.mul_(0.5) for v in s.params.values()], s)[1],
    "one param edited in place": lambda s: (
        s.params["0.weight"].add_(1.0), s)[1],
    "copy edited in place": lambda s: ([v.zero_() for v in s.compute_params.values()], s)[1],
    "state cloned by tree_map": clone_tree,
    "copy dropped": lambda s: s._replace(compute_params=None),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("donate", [False, True])
def test_a_copy_that_may_be_stale_is_rebuilt(edit, donate):
    step, state, (x, y) = _setup(fmp.optim.sgd(0.1, momentum=0.9), donate=donate)
    for i in range(2):
        state, _ = step(state, x, y, _factor(i))
    assert state.compute_params is not None
    with torch.no_grad():
        state = EDITS[edit](state)
    ref = _reference_after(state, x, y, donate)
    out, _ = step(state, x, y, _factor(0))
    assert_trees_bit_equal(out.params, ref.params)
    assert_trees_bit_equal(out.opt_state, ref.opt_state)


def test_data_writes_are_not_seen_until_the_copy_is_dropped():
    """The documented limit: ``.data`` writes bypass version counters."""
    step, state, (x, y) = _setup(fmp.optim.sgd(0.1))
    state, _ = step(state, x, y, _factor(0))
    for v in state.params.values():
        v.data.mul_(0.0)
    stale, _ = step(state, x, y, _factor(0))  # pure: state is not consumed
    ref = _reference_after(state, x, y, opt=fmp.optim.sgd(0.1))
    fresh, _ = step(state._replace(compute_params=None), x, y, _factor(0))
    assert_trees_bit_equal(fresh.params, ref.params)
    assert not torch.equal(stale.params["0.weight"], ref.params["0.weight"])


def test_a_copy_from_another_policy_is_not_used():
    step16, state, (x, y) = _setup(fmp.optim.sgd(0.1))
    step_bf, _, _ = _setup(fmp.optim.sgd(0.1), policy="bf16-mixed")
    state, _ = step16(state, x, y, _factor(0))
    out, _ = step_bf(state, x, y, _factor(0))
    assert {v.dtype for v in out.compute_params.values()} == {torch.bfloat16}
    ref_step, _, _ = _setup(fmp.optim.sgd(0.1), policy="bf16-mixed", compute_copy=False)
    ref, _ = ref_step(state._replace(compute_params=None), x, y, _factor(0))
    assert_trees_bit_equal(out.params, ref.params)


def test_no_copy_where_nothing_is_cast_and_under_a_whole_graph_trace():
    step, state, (x, y) = _setup(fmp.optim.sgd(0.1), policy="fp32")
    out, _ = step(state, x, y, _factor(0))
    assert out.compute_params is None
    step16, state16, _ = _setup(fmp.optim.sgd(0.1))
    state16, _ = step16(state16, x, y, _factor(0))
    traced = torch.compile(step16, backend="eager", fullgraph=True)
    out, _ = traced(state16, x, y, _factor(0))
    assert out.compute_params is None


def test_per_param_policies_copy_only_what_they_cast():
    """BatchNorm kept in float32: its params stay themselves in the copy; model state too."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 3))
    apply_fn, params, buffers = fmp.functional(net)
    pols = fmp.module_policies(net, "fp16-mixed", {torch.nn.BatchNorm1d: "fp32"})

    def loss_fn(p, ms, x, y):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(out.float(), y), new_ms

    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    runs = {}
    for copy in (True, False):
        opt = fmp.optim.adamw(1e-2)
        step = fmp.train_step(loss_fn, opt, "fp16-mixed", has_state=True,
                              param_policies=pols, compute_copy=copy, donate=True)
        s = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create(),
                                  model_state=clone_tree(buffers))
        for _ in range(3):
            s, _ = step(s, x, y)
        runs[copy] = s
    c = runs[True].compute_params
    assert c["1.weight"] is runs[True].params["1.weight"]
    assert c["0.weight"].dtype == torch.float16
    assert_trees_bit_equal(runs[True].params, runs[False].params)
    assert_trees_bit_equal(runs[True].model_state, runs[False].model_state)


def test_state_with_a_copy_saves_and_resumes_exactly():
    step, state, (x, y) = _setup(fmp.optim.adamw(1e-2))
    state, _ = step(state, x, y, _factor(0))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    a, _ = step(state, x, y, _factor(0))
    b, _ = step(loaded, x, y, _factor(0))
    assert_trees_bit_equal(a, b)


def test_stamps_do_not_keep_copies_alive():
    step, state, (x, y) = _setup(fmp.optim.sgd(0.1))
    n0 = len(step.stamps)
    for i in range(3):
        state, _ = step(state, x, y, _factor(i))
    assert len(step.stamps) <= n0 + 1
    del state
    import gc

    gc.collect()
    assert len(step.stamps) <= n0


def test_fmp_compile_two_graphs_use_the_copy_and_match_casting():
    step_c, s_c, (x, y) = _setup(fmp.optim.adamw(1e-2), donate=True)
    step_r, s_r, _ = _setup(fmp.optim.adamw(1e-2), donate=True, compute_copy=False)
    cstep = fmp.compile(step_c, backend="aot_eager")
    for i in range(5):
        s_c, m_c = cstep(s_c, x, y, _factor(i))
        s_r, m_r = step_r(s_r, x, y, _factor(i))
        assert bool(m_c["skipped"]) == bool(m_r["skipped"])
        assert s_c.compute_params is not None
        for k in s_r.params:
            torch.testing.assert_close(s_c.params[k], s_r.params[k], rtol=1e-4, atol=1e-5)
    pol = fmp.get_policy("fp16-mixed")
    assert_trees_bit_equal(s_c.compute_params, pol.cast_to_compute(s_c.params))
    assert optree.tree_structure(s_c) == optree.tree_structure(
        s_r._replace(compute_params=s_c.compute_params))


@pytest.mark.parametrize("tree", ["flat", "nested"])
def test_a_wrong_dtype_param_is_named_in_flat_and_nested_trees(tree):
    p = {"a": torch.ones(3), "b": torch.ones(3, dtype=torch.float16)}
    params = p if tree == "flat" else {"outer": p}
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda q, x: (q["a"] if tree == "flat" else q["outer"]["a"]).sum()
                          * x, opt, "fp16-mixed")
    state = fmp.TrainState.create(params, opt)
    name = "b" if tree == "flat" else "outer.b"
    with pytest.raises(ValueError, match=rf"param '{name}' is torch.float16 but the policy "
                                         r"keeps params in torch.float32"):
        step(state, torch.ones(()))


def test_nested_params_keep_a_copy_and_match_casting():
    """A params tree that is not a flat dict (optree's path) keeps and checks its copy too."""
    def loss_fn(p, x):
        return ((p["l1"]["w"] @ x).float().tanh().sum() + p["b"].float().sum()) ** 2

    params = {"l1": {"w": torch.randn(4, 4)}, "b": torch.randn(4)}
    x = torch.randn(4, 2)
    steps, states = {}, {}
    for copy in (True, False):
        opt = fmp.optim.adamw(1e-2)
        steps[copy] = fmp.train_step(loss_fn, opt, "bf16-mixed", compute_copy=copy)
        s = fmp.TrainState.create(clone_tree(params), opt)
        for _ in range(3):
            s, _ = steps[copy](s, x)
        states[copy] = s
    assert states[True].compute_params["l1"]["w"].dtype == torch.bfloat16
    assert_trees_bit_equal(states[True].params, states[False].params)
    with torch.no_grad():  # an in-place edit, seen through the nested tree's versions
        states[True].params["l1"]["w"].mul_(2.0)
        states[False].params["l1"]["w"].mul_(2.0)
    a, _ = steps[True](states[True], x)
    b, _ = steps[False](states[False], x)
    assert_trees_bit_equal(a.params, b.params)


OPS = ["step", "skip", "edit param", "edit copy", "replace params", "clone", "drop copy"]


@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=10), st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_any_sequence_of_steps_and_edits_trains_as_casting(ops, donate):
    """Whatever a user does to the state between steps, the copy step trains exactly as
    the step that casts every time."""
    step_c, s_c, (x, y) = _setup(fmp.optim.sgd(0.1, momentum=0.9), donate=donate)
    step_r, s_r, _ = _setup(fmp.optim.sgd(0.1, momentum=0.9), donate=donate,
                            compute_copy=False)
    for op in [*ops, "step"]:
        if op in ("step", "skip"):
            f = torch.tensor(float("inf") if op == "skip" else 1.0)
            s_c, m_c = step_c(s_c, x, y, f)
            s_r, m_r = step_r(s_r, x, y, f)
            assert bool(m_c["skipped"]) == bool(m_r["skipped"]) == (op == "skip")
            assert_trees_bit_equal(s_c.params, s_r.params)
            assert_trees_bit_equal(s_c.opt_state, s_r.opt_state)
        elif op == "edit param":
            with torch.no_grad():
                s_c.params["2.bias"].add_(0.25)
                s_r.params["2.bias"].add_(0.25)
        elif op == "edit copy" and s_c.compute_params is not None:
            with torch.no_grad():
                s_c.compute_params["0.weight"].mul_(-1.0)
        elif op == "replace params":
            s_c = s_c._replace(params={k: v * 0.5 for k, v in s_c.params.items()})
            s_r = s_r._replace(params={k: v * 0.5 for k, v in s_r.params.items()})
        elif op == "clone":
            s_c, s_r = clone_tree(s_c), clone_tree(s_r)
        elif op == "drop copy":
            s_c = s_c._replace(compute_params=None)
