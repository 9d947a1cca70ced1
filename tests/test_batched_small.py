"""fmp/_batched.py: the grouped clone and select give the per-tensor results bit for bit,
and a BatchNorm step launches a handful of kernels for its buffers, not one per buffer."""

from __future__ import annotations

import collections
import importlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import fmp
import fmp._batched as fmp_batched
import fmp._step_trees as fmp_step_trees
from fmp._batched import SMALL, clone_all, select_copy
from fmp._step_trees import select_into
from tests.helpers import assert_trees_bit_equal, clone_tree


@pytest.fixture(autouse=True)
def _batch_on_cpu(monkeypatch):
    """The select batches on accelerators only; here its batched path runs on CPU."""
    monkeypatch.setattr(fmp_batched, "BATCH_ON_CPU", True)


DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def _same(a: torch.Tensor, b: torch.Tensor, strides: bool = False) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and (not strides or a.numel() == 0 or a.stride() == b.stride())
            and torch.equal(_bits(a), _bits(b)))


def _tensor(draw, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(shape)
    if dtype == torch.int64:
        vals = draw(st.lists(st.integers(-2**40, 2**40), min_size=n, max_size=n))
        return torch.tensor(vals, dtype=dtype).view(shape)
    vals = draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, -3.25, 1e-30, float("inf"),
                                          float("-inf"), float("nan"), 65504.0]),
                         min_size=n, max_size=n))
    return torch.tensor(vals, dtype=torch.float32).to(dtype).view(shape)


@st.composite
def pairs(draw):
    k = draw(st.integers(0, 7))
    new, old = [], []
    for _ in range(k):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
        new.append(_tensor(draw, dtype, shape))
        old_dtype = draw(st.sampled_from((dtype, dtype, torch.float32)))
        old.append(_tensor(draw, old_dtype if dtype.is_floating_point else dtype, shape))
    return new, old


@settings(max_examples=150, deadline=None)
@given(pairs(), st.booleans())
def test_select_copy_matches_per_tensor_where(p, flag):
    new, old = p
    pred = torch.tensor(flag)
    want = [torch.where(pred, a, b.to(a.dtype)).to(b.dtype) for a, b in zip(new, old, strict=False)]
    ids = [id(b) for b in old]
    select_copy(pred, new, old)
    assert [id(b) for b in old] == ids  # written in place
    for got, w in zip(old, want, strict=False):
        assert _same(got, w)


@settings(max_examples=60, deadline=None)
@given(pairs())
def test_clone_all_copies_bit_for_bit_into_fresh_storage(p):
    new, _ = p
    out = clone_all(new)
    for a, c in zip(new, out, strict=False):
        assert _same(a, c, strides=True)
        if a.numel():
            assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


@pytest.mark.parametrize("has_foreach_clone", [True, False])
def test_clone_all_keeps_strides_of_a_non_contiguous_tensor(has_foreach_clone, monkeypatch):
    if not has_foreach_clone:  # torch without _foreach_clone: fresh tensors and a copy
        monkeypatch.delattr(torch, "_foreach_clone", raising=False)
    t = torch.arange(12.0).view(3, 4).t()
    n = torch.tensor([float("nan"), -0.0], dtype=torch.float16)
    c, m, k = clone_all([t, n, torch.tensor(7)])
    assert c.stride() == t.stride() and torch.equal(c, t)
    assert _same(n, m, strides=True) and k.dtype == torch.int64 and int(k) == 7


def test_large_and_non_contiguous_leaves_are_selected_on_their_own():
    big_new, big_old = torch.ones(SMALL + 1), torch.zeros(SMALL + 1)
    nc_new, nc_old = torch.ones(4, 3).t(), torch.zeros(4, 3).t()
    small = [torch.ones(3) for _ in range(3)], [torch.zeros(3) for _ in range(3)]
    new = [big_new, nc_new, *small[0]]
    old = [big_old, nc_old, *small[1]]
    select_copy(torch.tensor(False), new, old)
    assert all(not b.any() for b in old)
    select_copy(torch.tensor(True), new, old)
    assert all(b.all() for b in old)
    assert nc_old.stride() == (1, 3)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _bn_net(n: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(n):
        layers += [torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)]
    return torch.nn.Sequential(*layers)


def _bn_step(model: torch.nn.Module, donate: bool):
    apply_fn, params, buffers = fmp.functional(model)

    def loss_fn(p, ms, x, y):
        out, ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return ((out - y) ** 2).mean(), ms

    opt = fmp.optim.sgd(0.1, momentum=0.9)
    step = fmp.train_step(loss_fn, opt, "fp32", has_state=True, donate=donate)
    state = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create(),
                                  model_state=clone_tree(buffers))
    return step, state


def _ops_of_second_step(donate: bool) -> collections.Counter[str]:
    step, state = _bn_step(_bn_net(12), donate)  # 36 buffers
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    state, _ = step(state, x, y)
    count = _Count()
    with count:
        state, m = step(state, x, y)
    assert not bool(m["skipped"])
    return count.ops


@pytest.mark.parametrize("donate", [False, True])
def test_a_batchnorm_step_clones_and_selects_its_buffers_in_a_few_ops(donate, monkeypatch):
    """Against the per-tensor forms (what compiled code runs): the 36 buffer clones and,
    donated, their 36 wheres are gone, replaced by one multi-tensor clone (or copy into
    fresh tensors, where torch lacks ``_foreach_clone``) and one where per dtype."""
    batched = _ops_of_second_step(donate)
    for mod in (importlib.import_module("fmp.functional"), fmp_step_trees):
        monkeypatch.setattr(mod, "eager_kernels_ok", lambda: False)
    per_tensor = _ops_of_second_step(donate)
    assert per_tensor["clone"] - batched["clone"] == 36, (batched, per_tensor)
    assert 1 <= batched["_foreach_clone"] + batched["_foreach_copy_"] <= 4, batched
    if donate:
        assert per_tensor["where"] - batched["where"] == 36 - 2, (batched, per_tensor)


@pytest.mark.parametrize("donate", [False, True])
def test_batched_buffers_follow_a_plain_batchnorm_loop_and_skip_exactly(donate):
    """The running statistics the step carries are those of the module run in a plain loop
    with the same params; a skipped step (inf in the batch) leaves them bit for bit."""
    ref = _bn_net(3)
    step, state = _bn_step(_bn_net(3), donate)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(state.params[n])
            ref(x)  # train mode: updates ref's statistics as the step's forward should
        state, m = step(state, x, y)
        assert not bool(m["skipped"])
    for n, b in ref.named_buffers():
        torch.testing.assert_close(state.model_state[n], b, rtol=1e-6, atol=1e-7)
    _skip_leaves_all_as_it_was(step, state, x, y, float("inf"), count=3)


def _skip_leaves_all_as_it_was(step, state, x, y, bad_value: float, count: int):
    """A batch with ``bad_value`` in it: the step skips, buffers and params bit for bit."""
    before = clone_tree((state.model_state, state.params))
    bad = x.clone()
    bad[0, 0] = bad_value
    state, m = step(state, bad, y)
    assert bool(m["skipped"])
    assert_trees_bit_equal((state.model_state, state.params), before)
    assert int(state.model_state["1.num_batches_tracked"]) == count
    return state


def test_on_cpu_by_default_each_pair_gets_its_own_where(monkeypatch):
    monkeypatch.setattr(fmp_batched, "BATCH_ON_CPU", False)
    new = {"a": torch.ones(2), "b": torch.ones(3), "n": torch.tensor(4)}
    old = {"a": torch.zeros(2), "b": torch.zeros(3), "n": torch.tensor(1)}
    count = _Count()
    with count:
        out = select_into(torch.tensor(True), new, old)
    assert out is old and count.ops["where"] == 3 and count.ops["cat"] == 0
    assert_trees_bit_equal(old, new)


@pytest.mark.cuda
@pytest.mark.parametrize("flag", [False, True])
def test_cuda_select_copy_of_batchnorm_buffers_is_bit_exact(flag, monkeypatch):
    """On CUDA (the batched path by default): ResNet-style buffers, NaN and -0 included,
    selected in a handful of kernels, bit for bit what the per-tensor where gives."""
    monkeypatch.setattr(fmp_batched, "BATCH_ON_CPU", False)
    g = torch.Generator().manual_seed(0)
    old, new = [], []
    for c in (64, 256, 128, 512, 2048, 3):
        for side in (old, new):
            m = torch.randn(c, generator=g)
            m[0] = float("nan") if side is new else -0.0
            side.extend([m.cuda(), torch.rand(c, generator=g).cuda(),
                         torch.tensor(int(torch.randint(0, 99, (), generator=g))).cuda()])
    big_new, big_old = torch.randn(SMALL + 3).cuda(), torch.randn(SMALL + 3).cuda()
    new.append(big_new)
    old.append(big_old)
    pred = torch.tensor(flag, device="cuda")
    want = [torch.where(pred, a, b) for a, b in zip(new, old, strict=False)]
    count = _Count()
    with count:
        select_copy(pred, new, old)
    assert count.ops["where"] == 3  # float32 1-d, int64 0-d, the big one
    for got, w in zip(old, want, strict=False):
        assert _same(got, w)


@pytest.mark.cuda
def test_cuda_batchnorm_step_skips_with_buffers_bit_identical():
    step, state = _bn_step(_bn_net(4).cuda(), True)
    x, y = torch.randn(8, 4, device="cuda"), torch.randn(8, 4, device="cuda")
    for _ in range(2):
        state, m = step(state, x, y)
    state = _skip_leaves_all_as_it_was(step, state, x, y, float("nan"), count=2)
    state, m = step(state, x, y)
    assert not bool(m["skipped"])
    assert int(state.model_state["1.num_batches_tracked"]) == 3


def test_foreach_copy_of_a_mixed_list_copies_every_pair_with_conversion():
    dst = [torch.zeros(3), torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.float16),
           torch.zeros(2)]
    src = [torch.arange(3.0), torch.tensor(7), torch.tensor([1.5, 65504.0]),
           torch.tensor([0.1, 3.0], dtype=torch.bfloat16)]
    fmp_batched.foreach_copy_(dst, src)
    for d, s in zip(dst, src, strict=True):
        assert torch.equal(d, s.to(d.dtype))
    with pytest.raises(ValueError):
        fmp_batched.foreach_copy_(dst, src[:2])


def _cuda_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.cuda
def test_cuda_foreach_copy_of_a_mixed_list_launches_a_kernel_per_dtype_not_per_tensor():
    """torch's _foreach_copy_ of a list mixing float32 and int64 copies tensor by tensor
    (a memcpy each); grouped by dtype it is a multi-tensor kernel per group."""
    dst = [torch.zeros(64 * (1 + i % 4), device="cuda") for i in range(40)]
    dst += [torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(40)]
    src = [torch.ones_like(d) for d in dst]
    mixed = _cuda_kernels(lambda: torch._foreach_copy_(dst, src))
    grouped = _cuda_kernels(lambda: fmp_batched.foreach_copy_(dst, src))
    assert grouped <= 4 < mixed, (grouped, mixed)
    half = [torch.empty_like(s, dtype=torch.float16) for s in src[:40]]
    conv = _cuda_kernels(lambda: fmp_batched.foreach_copy_(half, src[:40]))
    print("float32 -> float16 copy of 40 tensors:", conv, "kernels")
