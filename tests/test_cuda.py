"""The train step on a CUDA GPU: no host sync, CUDA-graph capture, compile. Skipped without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp

pytestmark = pytest.mark.cuda

ONE = 1.0


def _setup(policy="fp16-mixed", opt=None, seed=0):
    net = mlp(seed=seed).cuda()
    apply_fn, params, _ = fmp.functional(net)
    opt = opt or fmp.optim.adamw(1e-2)

    def loss_fn(p, x, y, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), f).float(), y)

    step = fmp.train_step(loss_fn, opt, policy)
    ls = fmp.DynamicLossScale.create(initial=2.0**12, period=3)
    params = fmp.get_policy(policy).cast_to_param(clone_tree(params))
    state = fmp.TrainState.create(params, opt, ls)
    x, y = blobs(64)
    return step, state, x.cuda(), y.cuda()


@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed", "bf16-true"])
def test_cuda_trains_and_skips_bit_identically(policy):
    step, state, x, y = _setup(policy)
    one = torch.ones((), device="cuda")
    inf = torch.full((), float("inf"), device="cuda")
    assert state.loss_scale.loss_scale.device.type == "cuda"
    first = None
    for i in range(30):
        before = clone_tree(state)
        state, m = step(state, x, y, inf if i in (3, 10) else one)
        first = float(m["loss"]) if first is None else first
        if i in (3, 10):
            assert bool(m["skipped"])
            assert_trees_bit_equal(state.params, before.params)
            assert_trees_bit_equal(state.opt_state, before.opt_state)
    assert float(m["loss"]) < 0.25 * first
    assert int(state.skipped_total) == 2


def test_cuda_step_has_no_host_sync():
    step, state, x, y = _setup()
    one = torch.ones((), device="cuda")
    state, _ = step(state, x, y, one)  # warm-up: lazy inits may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            state, m = step(state, x, y, one)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(m["skipped"])


def _warm_up(step, state, *batch, n):
    """``n`` steps on a side stream, as CUDA-graph capture wants; the state after them."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            state, _ = step(state, *batch)
    torch.cuda.current_stream().wait_stream(s)
    return state


def _capture(step, state, *batch):
    """One call of ``step`` captured in a CUDA graph: (graph, its state out, its metrics)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, metrics = step(state, *batch)
    return g, out, metrics


def test_cuda_graph_capture_replays_the_step():
    step, state, x, y = _setup()
    f_static = torch.ones((), device="cuda")
    state = _warm_up(step, state, x, y, f_static, n=2)
    static_in = clone_tree(state)
    g, static_out, static_m = _capture(step, static_in, x, y, f_static)
    ref_state = clone_tree(static_in)
    for i in range(5):
        f_static.fill_(float("inf") if i == 2 else 1.0)
        ref_next, ref_m = step(ref_state, x, y, f_static)
        g.replay()
        torch.cuda.synchronize()
        assert bool(static_m["skipped"]) == (i == 2)
        torch.testing.assert_close(static_out.params, ref_next.params, rtol=0, atol=0)
        assert float(static_m["loss_scale"]) == float(ref_m["loss_scale"])
        # feed the outputs back in, as a training loop over a captured step does
        import optree

        for dst, src in zip(optree.tree_leaves(static_in), optree.tree_leaves(static_out),
                            strict=True):
            dst.copy_(src)
        ref_state = ref_next


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile", "fmp.compile", "fmp.compile-whole"])
def test_cuda_compiled_step_matches_eager(how):
    step, state, x, y = _setup()
    one = torch.ones((), device="cuda")
    inf = torch.full((), float("inf"), device="cuda")

    def plain():
        # torch.compile as the docs of fmp.inductor_workarounds tell a user to call it
        # (on torch >= 2.13 the patch is empty: plain torch.compile)
        compiled = torch.compile(step, fullgraph=True)

        def call(*a):
            with torch._inductor.config.patch(fmp.inductor_workarounds()):
                return compiled(*a)
        return call

    cstep = {"torch.compile": plain,
             "fmp.compile": lambda: fmp.compile(step),
             "fmp.compile-whole": lambda: fmp.compile(step, whole_graph=True)}[how]()
    s_e, s_c = clone_tree(state), clone_tree(state)
    for i in range(6):
        f = inf if i == 3 else one
        s_e, m_e = step(s_e, x, y, f)
        s_c, m_c = cstep(s_c, x, y, f)
        assert bool(m_e["skipped"]) == bool(m_c["skipped"]) == (i == 3)
        assert float(m_e["loss_scale"]) == float(m_c["loss_scale"])
        for k in s_e.params:
            torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not fmp.inductor_workarounds(), reason="no inductor workaround on this torch")
@pytest.mark.xfail(strict=True, raises=Exception,
                   reason="pytorch/pytorch#176591: inductor's loop reordering asserts on a "
                          "graph mixing foreach ops and per-tensor reductions")
def test_cuda_plain_torch_compile_needs_the_workaround():
    """Why fmp.inductor_workarounds exists: without it this torch's inductor cannot compile
    the step. Strict: once a torch in the gate compiles it, the workaround's gate is wrong."""
    torch._dynamo.reset()  # no compiled code of an earlier test's (patched) compile
    step, state, x, y = _setup()
    torch.compile(step, fullgraph=True)(state, x, y, torch.ones((), device="cuda"))


@pytest.mark.slow
def test_cuda_graph_of_fmp_compiled_donated_step():
    """fmp.compile's two graphs (loss fwd/bwd, then update) with donation, captured in one
    CUDA graph: replays update the state in place as the eager donated step does, and skip."""
    import optree

    net = mlp(seed=0).cuda()
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.adamw(1e-2)

    def loss_fn(p, x, y, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), f).float(), y)

    eager = fmp.train_step(loss_fn, opt, "fp16-mixed", donate=True)
    cstep = fmp.compile(fmp.train_step(loss_fn, opt, "fp16-mixed", donate=True))
    x, y = (t.cuda() for t in blobs(64))
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**12, period=3))
    f = torch.ones((), device="cuda")
    state = _warm_up(cstep, state, x, y, f, n=3)
    ref = clone_tree(state)
    g, out, m = _capture(cstep, state, x, y, f)
    k0 = next(iter(state.params))
    assert out.params[k0] is state.params[k0]  # donated: written in place
    small = [(d, s_) for d, s_ in zip(optree.tree_leaves(state), optree.tree_leaves(out),
                                      strict=True) if isinstance(d, torch.Tensor) and d is not s_]
    for i in range(5):
        f.fill_(float("inf") if i == 2 else 1.0)
        before = clone_tree(state.params)
        ref, ref_m = eager(ref, x, y, f)
        g.replay()
        torch._foreach_copy_([d for d, _ in small], [s_ for _, s_ in small])
        torch.cuda.synchronize()
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        assert float(m["loss_scale"]) == float(ref_m["loss_scale"])
        assert int(state.step) == int(ref.step)
        if i == 2:
            assert_trees_bit_equal(state.params, before)
        torch.testing.assert_close(state.params, ref.params, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(state.opt_state, ref.opt_state, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed"])
def test_cuda_compute_copy_gives_the_bits_of_casting(policy, donate):
    """The params' compute copy (read by the forward, written by the update; the fused
    kernels when donated) trains bit for bit as casting every step, skips included."""
    net = mlp(seed=0).cuda()
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, x, y, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), f).float(), y)

    x, y = (t.cuda() for t in blobs(64))
    runs = []
    for copy in (True, False):
        opt = fmp.optim.adamw(1e-2)
        step = fmp.train_step(loss_fn, opt, policy, donate=donate, compute_copy=copy)
        s = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**12, period=3))
        ms = []
        for i in range(6):
            s, m = step(s, x, y, torch.full((), float("inf") if i == 2 else 1.0,
                                            device="cuda"))
            ms.append((float(m["loss"]), bool(m["skipped"])))
        runs.append((s, ms))
    (s_c, m_c), (s_r, m_r) = runs
    assert m_c == m_r and m_c[2][1]
    assert s_c.compute_params is not None and s_r.compute_params is None
    assert_trees_bit_equal(s_c.params, s_r.params)
    assert_trees_bit_equal(s_c.opt_state, s_r.opt_state)
    assert_trees_bit_equal(s_c.compute_params,
                           fmp.get_policy(policy).cast_to_compute(s_c.params))
