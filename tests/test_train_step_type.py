"""The step is a type (fmp.TrainStep), data parallelism sits above it (a reducer), and the
core keeps no process-global state (stamps per step, PRESETS read-only, checks per reducer)."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import optree
import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp

FMP = pathlib.Path(fmp.__file__).parent


def _setup(opt=None, policy="fp16-mixed", **kw):
    x, y = blobs(32)
    apply_fn, params, _ = fmp.functional(mlp(seed=1))
    opt = opt or fmp.optim.adamw(1e-2)

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    step = fmp.train_step(loss_fn, opt, policy, **kw)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**10, period=2))
    return step, state, (x, y)


def _factor(inf=False):
    return torch.tensor(float("inf") if inf else 1.0)


# ---- the type --------------------------------------------------------------------------

def test_train_step_returns_a_frozen_train_step_with_named_phases():
    step, state, (x, y) = _setup()
    assert isinstance(step, fmp.TrainStep)
    assert "TrainStep" in fmp.__all__ and "CompiledStep" in fmp.__all__
    assert not hasattr(step, "_fmp_phases") and not hasattr(step, "__wrapped__")
    for name in ("scaled_loss", "update_phase", "run", "prepare", "private"):
        assert callable(getattr(step, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.update_phase = lambda *a: None
    with pytest.raises(dataclasses.FrozenInstanceError):
        step._fmp_phases = None
    # calling it is running its phases
    a, m_a = step(clone_tree(state), x, y, _factor())
    b, m_b = step.run(clone_tree(state), (x, y, _factor()), step.scaled_loss,
                      step.update_phase)
    assert_trees_bit_equal(a.params, b.params)
    assert_trees_bit_equal(m_a, m_b)


def test_cuda_graph_takes_train_steps_compiled_steps_and_plain_functions_as_before():
    """Without a GPU every kind gets as far as the device check (none is refused by type)."""
    step, state, (x, y) = _setup()
    compiled = fmp.compile(step, backend="eager")
    assert isinstance(compiled, fmp.CompiledStep) and compiled.step is step
    assert not compiled.whole_graph
    assert fmp.compile(step, whole_graph=True, backend="eager").whole_graph
    again = fmp.compile(compiled, whole_graph=True, backend="eager")
    assert isinstance(again, fmp.CompiledStep) and again.step is step and again.whole_graph
    for s in (step, compiled, lambda st, *b: step(st, *b)):
        with pytest.raises(ValueError, match=r"state\.params\['0\.bias'\] is on cpu"):
            fmp.cuda_graph(s, state, x, y, _factor())


def test_fmp_compile_of_a_plain_function_is_unchanged():
    f = fmp.compile(lambda t: t * 2, backend="eager")
    assert not isinstance(f, fmp.CompiledStep)
    assert float(f(torch.ones(()))) == 2.0


@pytest.mark.slow
def test_compiled_step_is_frozen_and_matches_eager():
    step, state, (x, y) = _setup(donate=True)
    compiled = fmp.compile(step, backend="eager")
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.step = step
    s_e, s_c = clone_tree(state), clone_tree(state)
    for inf in (False, True, False):
        s_e, m_e = step(s_e, x, y, _factor(inf))
        s_c, m_c = compiled(s_c, x, y, _factor(inf))
        assert bool(m_c["skipped"]) == bool(m_e["skipped"]) == inf
        # (the eager donated step runs torch's fused kernel, the compiled one the pure path)
        torch.testing.assert_close(s_c.params, s_e.params, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["step", "compiled", "plain"])
def test_cuda_graph_of_each_kind_equals_the_eager_step(how):
    step, state, (x, y) = _setup(donate=True)
    state = optree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, state)
    x, y = x.cuda(), y.cuda()
    f = torch.ones((), device="cuda")
    target = {"step": step, "compiled": fmp.compile(step),
              "plain": lambda st, *b: step(st, *b)}[how]
    ref = clone_tree(state)
    graphed = fmp.cuda_graph(target, state, x, y, f, warmup=3)
    s = graphed.state
    for _ in range(3):
        ref, _ = step(ref, x, y, f)
        s, _ = graphed(s, x, y, f)
    torch.testing.assert_close(s.params, ref.params, rtol=1e-5, atol=1e-6)


# ---- data parallelism above the step ---------------------------------------------------

def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _step_modules() -> list[pathlib.Path]:
    """fmp/step.py and the private modules it is built from (``fmp/_step*.py`` etc.)."""
    names = ["step.py", "_step_type.py", "_compute_copy.py", "_donation.py", "_grad.py"]
    names += [p.name for p in FMP.glob("_step_*.py")]
    return sorted({FMP / n for n in names if (FMP / n).exists()})


def test_the_step_imports_nothing_of_fmp_distributed():
    for path in _step_modules():
        bad = {m for m in _imports(path) if m.startswith("fmp.distributed")}
        assert not bad, f"{path.name} imports {bad}"
    # and the dependency points one way: distributed knows no step
    assert not {m for m in _imports(FMP / "distributed.py") if m.startswith("fmp.step")}


class _Recorder:
    """A one-process reducer that records what the step hands it."""

    def __init__(self):
        self.reduced, self.checked = [], []

    def reduce(self, grads):
        self.reduced.append(clone_tree(grads))
        return grads

    def all_finite(self, grads):
        self.checked.append(clone_tree(grads))
        return fmp.all_finite(grads)


@pytest.mark.parametrize("fused", [False, True])
def test_a_reducer_object_reduces_at_the_points_process_group_does(fused):
    """Fused path (donated sgd): the scaled grads are reduced; else the unscaled ones."""
    opt = fmp.optim.sgd(0.1)
    rec = _Recorder()
    step, state, (x, y) = _setup(opt, "fp32", donate=fused, reducer=rec)
    ref, ref_state, _ = _setup(opt, "fp32", donate=fused)
    s, _ = step(state, x, y, _factor())
    r, _ = ref(ref_state, x, y, _factor())
    assert_trees_bit_equal(s.params, r.params)  # an identity reducer changes nothing
    assert len(rec.reduced) == len(rec.checked) == 1
    vg = fmp.value_and_grad(lambda p, a, b: F.cross_entropy(
        fmp.functional(mlp(seed=1))[0](p, a).float(), b))
    _, grads, _ = vg(clone_tree(ref_state.params), fmp.NoOpLossScale(), x, y)
    scale = 2.0**10 if fused else 1.0
    for k, g in rec.reduced[0].items():
        torch.testing.assert_close(g, grads[k] * scale, rtol=1e-5, atol=1e-6)


def test_reducer_and_process_group_together_or_a_bad_reducer_are_errors():
    opt = fmp.optim.sgd(0.1)
    with pytest.raises(TypeError, match="process_group or reducer, not both"):
        fmp.train_step(lambda p, x: x.sum(), opt, process_group="default",
                       reducer=_Recorder())
    with pytest.raises(TypeError, match="reducer must have reduce"):
        fmp.train_step(lambda p, x: x.sum(), opt, reducer=object())


@pytest.fixture
def one_rank_group():
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_each_reducer_checks_the_tree_once_for_itself(one_rank_group, monkeypatch):
    calls = []
    orig = torch.distributed.all_gather_object
    monkeypatch.setattr(torch.distributed, "all_gather_object",
                        lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    tree = {"w": torch.ones(3)}
    a, b = fmp.distributed.GroupReducer("default"), fmp.distributed.GroupReducer()
    assert isinstance(a, fmp.GradReducer)
    for _ in range(3):
        torch.testing.assert_close(a.reduce(tree), tree)
    assert len(calls) == 1
    b.reduce(tree)  # another step's reducer: its own check
    assert len(calls) == 2
    assert bool(a.all_finite(tree)) and not bool(a.all_finite({"w": torch.tensor([1e9]) * 1e30}))


def test_is_dtensor_is_public():
    assert "is_dtensor" in fmp.distributed.__all__
    assert not fmp.distributed.is_dtensor(torch.ones(2))
    assert not fmp.distributed.is_dtensor(None)


# ---- no process-global state -----------------------------------------------------------

def test_presets_are_read_only_with_a_clear_error():
    before = dict(fmp.PRESETS)
    with pytest.raises(TypeError, match=r"fmp\.PRESETS is read-only.*fmp\.Policy"):
        fmp.PRESETS["bf16-mixed"] = fmp.get_policy("fp32")
    with pytest.raises(TypeError, match="read-only"):
        del fmp.PRESETS["fp32"]
    with pytest.raises(TypeError, match="read-only"):
        fmp.PRESETS.update(mine=fmp.get_policy("fp32"))
    with pytest.raises(TypeError, match="read-only"):
        fmp.PRESETS.pop("fp32")
    assert dict(fmp.PRESETS) == before
    assert fmp.get_policy("bf16-mixed") == fmp.Policy(torch.float32, torch.bfloat16,
                                                      torch.float32)
    assert list(fmp.PRESETS)[:2] == ["fp32", "bf16-mixed"]
    mine = fmp.PRESETS.copy()
    mine["x"] = fmp.get_policy("fp32")  # a copy is the user's own
    assert "x" not in fmp.PRESETS


def test_two_steps_keep_independent_compute_copy_stamps():
    step_a, state, (x, y) = _setup()
    step_b, _, _ = _setup()
    assert len(step_a.stamps) == len(step_b.stamps) == 0
    s_a, _ = step_a(state, x, y, _factor())
    assert len(step_a.stamps) == 1 and len(step_b.stamps) == 0
    # a's copy is current for a, not vouched for by b: b rebuilds it (the same bits)
    assert step_a.prepare(s_a) is s_a
    s_b = step_b.prepare(s_a)
    assert s_b.compute_params is not s_a.compute_params
    assert_trees_bit_equal(s_b.compute_params, s_a.compute_params)
    assert len(step_b.stamps) == 1
    # and both train on from there to the same bits as casting every step
    ref, ref_state, _ = _setup(compute_copy=False)
    r, _ = ref(ref_state, x, y, _factor())
    a2, _ = step_a(s_a, x, y, _factor())
    b2, _ = step_b(s_a, x, y, _factor())
    r2, _ = ref(r, x, y, _factor())
    assert_trees_bit_equal(a2.params, r2.params)
    assert_trees_bit_equal(b2.params, r2.params)


# ---- host work of an eager donated step ------------------------------------------------

def test_a_donated_fused_step_checks_its_trees_once_and_copies_nothing_after_the_first(
        monkeypatch):
    """The fused path's leaf lists are built once per step (the update reuses the check),
    and the state a donated step returned is private already: no copy on the next call."""
    from fmp import _step_trees
    from fmp.optim import _inplace

    calls = {"lists": 0, "private": 0}
    lists, private = _inplace._lists, _step_trees.private

    def count(name, fn):
        def counted(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return counted

    monkeypatch.setattr(_inplace, "_lists", count("lists", lists))
    monkeypatch.setattr(_step_trees, "private", count("private", private))
    step, state, (x, y) = _setup(fmp.optim.adamw(1e-2), donate=True)
    ref, ref_state, _ = _setup(fmp.optim.adamw(1e-2), donate=False)
    state, _ = step(state, x, y, _factor())  # the first call copies the module's tensors
    ref_state, _ = ref(ref_state, x, y, _factor())
    calls.update(lists=0, private=0)
    for inf in (False, True, False):
        state, m = step(state, x, y, _factor(inf))
        ref_state, m_r = ref(ref_state, x, y, _factor(inf))
        assert bool(m["skipped"]) == bool(m_r["skipped"]) == inf
        torch.testing.assert_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert calls == {"lists": 3, "private": 0}


def test_host_walks_script_counts_a_few_walks_per_donated_step():
    """benchmarks/host_walks.py runs, and one eager donated step walks its trees a few
    times (before issue 17: 17 optree walks and 58 Python passes over the leaves; 34
    until 2026-12-07, 39 since: the forward's own slot swap and the copies grouped by
    dtype loop over the leaves where torch.func.functional_call and per-tensor copies
    walked them inside torch, at some 20 times the host cost on ResNet-50; 42 since the
    module list and the slot-count check live in fmp/_reparam.py instead of torch's
    named_modules, which the count does not see)."""
    import sys

    sys.path.insert(0, str(FMP.parent / "benchmarks"))
    try:
        import host_walks
    finally:
        sys.path.pop(0)
    r = host_walks.measure("mlp", steps=1)
    assert r["params"] == 34
    assert 0 < r["optree_walks"] <= 13 and 0 < r["python_leaf_loops"] <= 42, r
    assert not any("_lists" in k for k, v in r["by_caller"].items() if v > 1), r
