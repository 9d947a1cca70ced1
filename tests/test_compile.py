"""fmp.compile of the train step (two graphs, or one: whole_graph) equals eager, skips too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp

pytestmark = pytest.mark.slow


def _run(backend, whole_graph=False):
    x, y = blobs(32)
    net = mlp(seed=1)
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(loss_fn, opt, "fp16-mixed")
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**10, period=2,
                                                              min_scale=0.25))
    cstep = fmp.compile(step, backend=backend, whole_graph=whole_graph)
    s_e, s_c = clone_tree(state), clone_tree(state)
    for i in range(6):
        f = torch.tensor(float("inf") if i in (2, 3) else 1.0)
        before = clone_tree(s_c)
        s_e, m_e = step(s_e, x, y, f)
        s_c, m_c = cstep(s_c, x, y, f)
        assert bool(m_c["skipped"]) == bool(m_e["skipped"]) == (i in (2, 3))
        assert float(m_c["loss_scale"]) == float(m_e["loss_scale"])
        assert s_c.loss_scale.min_scale == 0.25
        if i in (2, 3):
            assert_trees_bit_equal(s_c.params, before.params)
            assert_trees_bit_equal(s_c.opt_state, before.opt_state)
        for k in s_e.params:
            torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("whole_graph", [False, True])
def test_compiled_step_matches_eager_aot_eager(whole_graph):
    _run("aot_eager", whole_graph)


def test_two_graph_step_with_state_accumulation_and_aux():
    """The two-graph compile carries model state, micro-batches and aux as eager does."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 3))
    apply_fn, params, buffers = fmp.functional(net)

    def loss_fn(p, ms, x, y):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(out.float(), y), (new_ms, out.float().mean())

    opt = fmp.optim.sgd(0.1, momentum=0.9)
    pols = fmp.module_policies(net, "bf16-mixed", {torch.nn.BatchNorm1d: "fp32"})
    step = fmp.train_step(loss_fn, opt, "bf16-mixed", accumulate=2, has_state=True,
                          has_aux=True, param_policies=pols)
    cstep = fmp.compile(step, backend="aot_eager")
    s_e = fmp.TrainState.create(clone_tree(params), opt, model_state=clone_tree(buffers))
    s_c = clone_tree(s_e)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(3):
        s_e, m_e = step(s_e, x, y)
        s_c, m_c = cstep(s_c, x, y)
        torch.testing.assert_close(m_c["aux"], m_e["aux"])
        torch.testing.assert_close(m_c["loss"], m_e["loss"])
    torch.testing.assert_close(s_c.params, s_e.params)
    torch.testing.assert_close(s_c.model_state, s_e.model_state)
    assert int(s_c.model_state["1.num_batches_tracked"]) == 6


def test_two_graph_step_names_a_param_of_the_wrong_dtype():
    net = mlp(seed=1)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda p, a: apply_fn(p, a).float().sum(), opt, "bf16-true")
    state = fmp.TrainState.create(params, opt)  # float32 params, policy keeps bf16
    with pytest.raises(ValueError, match=r"but the policy keeps params in torch\.bfloat16"):
        fmp.compile(step, backend="eager")(state, torch.randn(2, 2))


def test_compiled_step_matches_eager_inductor():
    _run("inductor")


def test_workarounds_only_on_old_torch(monkeypatch):
    import fmp._compile as fc

    monkeypatch.setattr(fc, "_torch_version", lambda: (2, 11))
    assert fmp.inductor_workarounds() == {"loop_ordering_after_fusion": False}
    monkeypatch.setattr(fc, "_torch_version", lambda: (2, 13))
    assert fmp.inductor_workarounds() == {}


def test_two_graph_donated_step_does_not_recompile():
    """After the first call, steps (skipped ones too) reuse the two graphs; donation writes
    the state in place as the eager donated step does."""
    x, y = blobs(32)
    apply_fn, params, _ = fmp.functional(mlp(seed=2))

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    opt = fmp.optim.adamw(1e-2)
    eager = fmp.train_step(loss_fn, opt, "fp16-mixed", donate=True)
    cstep = fmp.compile(fmp.train_step(loss_fn, opt, "fp16-mixed", donate=True),
                        backend="aot_eager")
    s_e = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create())
    s_c = clone_tree(s_e)
    one = torch.ones(())
    s_e, _ = eager(s_e, x, y, one)
    s_c, _ = cstep(s_c, x, y, one)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(4):
            f = torch.tensor(float("inf") if i == 1 else 1.0)
            before = clone_tree(s_c.params)
            w = s_c.params["0.weight"]
            s_e, m_e = eager(s_e, x, y, f)
            s_c, m_c = cstep(s_c, x, y, f)
            assert s_c.params["0.weight"] is w  # donated: the same tensor, updated in place
            assert bool(m_c["skipped"]) == bool(m_e["skipped"]) == (i == 1)
            assert float(m_c["loss_scale"]) == float(m_e["loss_scale"])
            if i == 1:
                assert_trees_bit_equal(s_c.params, before)
            torch.testing.assert_close(s_c.params, s_e.params, rtol=1e-4, atol=1e-5)


def test_whole_graph_traces_once_for_states_with_and_without_a_compute_copy():
    # the eager step hands back a compute copy, the whole-graph trace none: one trace must
    # serve both (a recompile inside fmp.cuda_graph's capture cannot run)
    from torch._dynamo.testing import CompileCounter

    x, y = blobs(32)
    apply_fn, params, _ = fmp.functional(mlp(seed=1))
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda p, a, b: F.cross_entropy(apply_fn(p, a).float(), b), opt,
                          "bf16-mixed")
    state = fmp.TrainState.create(clone_tree(params), opt)
    with_copy, _ = step(state, x, y)
    assert with_copy.compute_params is not None
    counter = CompileCounter()
    cstep = fmp.compile(step, whole_graph=True, backend=counter)
    ref, _ = step(with_copy, x, y)
    out, _ = cstep(with_copy, x, y)
    assert out.compute_params is None
    cstep(out, x, y)  # the state without a copy: the same trace
    assert counter.frame_count == 1
    assert_trees_bit_equal(out.params, ref.params)


@pytest.mark.parametrize("whole_graph", [False, True])
def test_steps_compiled_in_one_process_keep_static_shapes(whole_graph):
    # two steps of different shapes: the second must not recompile the first's code and
    # have its shapes marked dynamic (slower kernels; a guard crash on torch 2.11)
    symbolic = []

    def backend(gm, example_inputs):
        vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        symbolic.append(any(isinstance(d, torch.SymInt) for t in vals
                            if isinstance(t, torch.Tensor) for d in t.shape))
        return gm.forward

    for n in (8, 12):
        net = torch.nn.Sequential(torch.nn.Linear(n, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 2))
        apply_fn, params, _ = fmp.functional(net)
        opt = fmp.optim.sgd(0.1)
        step = fmp.train_step(lambda p, a, b, f=apply_fn: F.cross_entropy(f(p, a).float(), b),
                              opt, "bf16-mixed")
        state = fmp.TrainState.create(params, opt)
        cstep = fmp.compile(step, whole_graph=whole_graph, backend=backend)
        x, y = torch.randn(4, n), torch.randint(0, 2, (4,))
        for _ in range(2):
            state, _ = cstep(state, x, y)
    assert symbolic and not any(symbolic)
