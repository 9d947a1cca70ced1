"""fmp.compile(step, update="eager"): the loss compiled, the update phase run as the eager
step runs it (torch's fused in-place kernels for a donated step), skips included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp


def _make(device="cpu", opt=None):
    net = mlp(seed=3).to(device)
    apply_fn, params, _ = fmp.functional(net)
    opt = opt or fmp.optim.adamw(1e-2, weight_decay=0.1)

    def loss_fn(p, x, y, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), f).float(), y)

    step = fmp.train_step(loss_fn, opt, "fp16-mixed", donate=True)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**12, period=2),
                                  donate=True)
    x, y = (t.to(device) for t in blobs(64))
    return step, state, x, y


def _counting_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_only_the_loss_is_compiled_and_the_results_are_the_eager_steps(opt):
    """One dynamo graph (the loss; the compiled update would be a second), and the state
    after every step, a skipped one included, as the eager donated step leaves it."""
    make = {"adamw": lambda: fmp.optim.adamw(1e-2, weight_decay=0.1),
            "sgd": lambda: fmp.optim.sgd(0.05, momentum=0.9)}[opt]
    step, state, x, y = _make(opt=make())
    ref_step, ref, _, _ = _make(opt=make())
    graphs = []
    cstep = fmp.compile(step, update="eager", backend=_counting_backend(graphs))
    assert isinstance(cstep, fmp.CompiledStep) and cstep.update == "eager"
    s = state
    for i in range(5):
        f = torch.tensor(float("inf") if i == 2 else 1.0)
        before = clone_tree(s)
        ref, ref_m = ref_step(ref, x, y, f)
        s, m = cstep(s, x, y, f)
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        if i == 2:
            assert_trees_bit_equal(s.params, before.params)
            assert_trees_bit_equal(s.opt_state, before.opt_state)
            assert float(s.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
        assert_trees_bit_equal(m["loss"], ref_m["loss"])
        assert_trees_bit_equal(s.params, ref.params)
        assert_trees_bit_equal(s.opt_state, ref.opt_state)
        assert_trees_bit_equal(s.loss_scale, ref.loss_scale)
        assert_trees_bit_equal(s.compute_params, ref.compute_params)
    assert len(graphs) == 1, [g.code[:200] for g in graphs]


def test_the_default_compiles_the_update_too_and_nothing_recompiles():
    """Two graphs, traced once: the slot-plan cache of fmp.functional read under dynamo
    made the loss graph recompile on the second call (4 s of an H100 build)."""
    step, state, x, y = _make()
    graphs = []
    cstep = fmp.compile(step, backend=_counting_backend(graphs))
    assert cstep.update == "compiled"
    for _ in range(3):
        state, _ = cstep(state, x, y, torch.tensor(1.0))
    assert len(graphs) == 2, [g.code[:300] for g in graphs]


def test_bad_update_values_are_named():
    step, _, _, _ = _make()
    with pytest.raises(ValueError, match=r"update='fused' is not accepted; use one of "
                                         r"'compiled', 'eager', 'auto'"):
        fmp.compile(step, update="fused")
    with pytest.raises(ValueError, match="whole_graph=True traces the update"):
        fmp.compile(step, update="eager", whole_graph=True)
    with pytest.raises(ValueError, match="got function, not a TrainStep"):
        fmp.compile(lambda t: t, update="eager")


def test_auto_takes_the_eager_update_where_it_runs_fused_in_place():
    """A donated adamw step: "auto" comes to eager on the first call (one dynamo graph, the
    loss), and its states are the eager step's, bit for bit, a skipped step included."""
    step, state, x, y = _make()
    ref_step, ref, _, _ = _make()
    graphs = []
    cstep = fmp.compile(step, update="auto", backend=_counting_backend(graphs))
    assert cstep.update == "auto" and cstep.update_used is None  # not decided yet
    s = state
    for i in range(3):
        f = torch.tensor(float("inf") if i == 1 else 1.0)
        ref, ref_m = ref_step(ref, x, y, f)
        s, m = cstep(s, x, y, f)
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 1)
        assert_trees_bit_equal((s.params, s.opt_state, s.loss_scale),
                               (ref.params, ref.opt_state, ref.loss_scale))
    assert cstep.update_used == "eager"
    assert len(graphs) == 1, [g.code[:200] for g in graphs]


@pytest.mark.parametrize("why", ["not donated", "a chain", "no fused form"])
def test_auto_compiles_the_update_where_no_fused_kernel_applies(why):
    """Not donated, a chain of two transformations, or an optimizer with no fused form
    (sgd with dampening): "auto" compiles the update (two graphs), with the eager step's
    results."""
    net = mlp(seed=3)
    apply_fn, params, _ = fmp.functional(net)
    opt = {"no fused form": lambda: fmp.optim.sgd(0.05, momentum=0.9, dampening=0.5),
           "a chain": lambda: fmp.optim.chain(fmp.optim.scale(0.5), fmp.optim.adamw(1e-2)),
           "not donated": lambda: fmp.optim.adamw(1e-2)}[why]()
    donate = why != "not donated"

    def loss_fn(p, x, y):
        out = apply_fn({k: v.float() for k, v in p.items()}, x)
        return F.cross_entropy(out, y)

    step = fmp.train_step(loss_fn, opt, "fp32", donate=donate)
    x, y = blobs(64)
    states = [fmp.TrainState.create(clone_tree(params), opt, None, donate=donate)
              for _ in range(2)]
    graphs = []
    cstep = fmp.compile(step, update="auto", backend=_counting_backend(graphs))
    s, ref = states
    for _ in range(2):
        s, m = cstep(s, x, y)
        ref, ref_m = step(ref, x, y)
    assert cstep.update_used == "compiled"
    assert len(graphs) == 2, [g.code[:200] for g in graphs]
    torch.testing.assert_close(s.params, ref.params, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["loss"], ref_m["loss"])


def test_auto_is_compiled_for_a_whole_graph_step():
    step, _, _, _ = _make()
    cstep = fmp.compile(step, update="auto", whole_graph=True, backend="eager")
    assert cstep.update_used == "compiled"


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("update", ["eager", "auto"])
def test_in_a_cuda_graph_equal_to_the_eager_step(update):
    """Captured whole (compiled loss, fused update): replays equal the eager donated step's
    states, the skipped step leaves everything as it was."""
    step, state, x, y = _make("cuda")
    ref_step, ref, _, _ = _make("cuda")

    def factor(i):
        return torch.full((), float("inf") if i == 2 else 1.0, device="cuda")

    cstep = fmp.compile(step, update=update)
    graphed = fmp.cuda_graph(cstep, state, x, y, factor(0), warmup=3)
    assert cstep.update_used == "eager"
    s = graphed.state
    for i in range(5):
        before = clone_tree(s)
        ref, ref_m = ref_step(ref, x, y, factor(i))
        s, m = graphed(s, x, y, factor(i))
        assert bool(m["skipped"]) == bool(ref_m["skipped"]) == (i == 2)
        if i == 2:
            assert_trees_bit_equal(s.params, before.params)
            assert_trees_bit_equal(s.opt_state, before.opt_state)
        torch.testing.assert_close(s.params, ref.params, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(s.opt_state, ref.opt_state, rtol=1e-3, atol=1e-4)
    assert_trees_bit_equal(s.compute_params,
                           fmp.get_policy("fp16-mixed").cast_to_compute(s.params))
