"""The pure unscale's verdict is read from the scaled grads, and it is exactly all_finite's.

``unscale_and_check(grads, like=...)`` (in_place=False) converts, unscales and then reports
whether the result is finite. The verdict is computed from the grads' largest magnitudes
(so a compiled step does not write the unscaled grads out for the check); these tests hold
it to ``fmp.all_finite`` of the unscaled tree, bit for bit in the values, on the edges
where rounding decides: values that overflow only once unscaled, narrow dtypes that
overflow when rounded back, NaN, inf, empty leaves, float64, micro-batches.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fmp
from fmp.tree import to_dtypes_of

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [0.0, 1.0, -1.0, 65504.0, -65504.0, 3.0e38, -3.3e38, 1e-30, float("inf"),
           float("-inf"), float("nan"), 2.0**-24, 1.5e38]


def _records():
    return [fmp.NoOpLossScale(), fmp.StaticLossScale(1.0), fmp.StaticLossScale(2.0**16),
            fmp.StaticLossScale(3.0), fmp.StaticLossScale(2.0**-20), fmp.StaticLossScale(0.7),
            fmp.DynamicLossScale.create(2.0**-126, min_scale=2.0**-126)]


def _reference(ls, grads, like, k):
    out = ls.unscale(grads if like is None else to_dtypes_of(grads, like), micro_batches=k)
    return out, fmp.all_finite(out)


@st.composite
def _case(draw):
    n = draw(st.integers(1, 4))
    grads, like = {}, {}
    for i in range(n):
        src = draw(st.sampled_from(DTYPES))
        dst = draw(st.sampled_from([src, torch.float32, torch.float64]))
        size = draw(st.integers(0, 5))
        vals = draw(st.lists(st.one_of(st.sampled_from(SPECIAL),
                                       st.floats(-1e6, 1e6, allow_nan=False)),
                             min_size=size, max_size=size))
        grads[f"g{i}"] = torch.tensor(vals, dtype=torch.float64).to(src)
        like[f"g{i}"] = torch.zeros(size, dtype=dst)
    ls = draw(st.sampled_from(_records()))
    return grads, draw(st.sampled_from([None, like])), ls, draw(st.sampled_from([1, 2, 3]))


@settings(max_examples=400, deadline=None)
@given(_case())
def test_the_verdict_equals_all_finite_of_the_unscaled_grads(case):
    grads, like, ls, k = case
    out, ok = ls.unscale_and_check(grads, like=like, micro_batches=k)
    ref_out, ref_ok = _reference(ls, grads, like, k)
    assert bool(ok) == bool(ref_ok)
    assert ok.dtype == torch.bool and ok.shape == ()
    for name in ref_out:
        assert out[name].dtype == ref_out[name].dtype
        assert torch.equal(out[name].nan_to_num(), ref_out[name].nan_to_num())


@pytest.mark.parametrize(("dtype", "value", "scale"), [
    (torch.float16, 30000.0, 0.25),   # 120000: beyond float16's range
    (torch.bfloat16, 1.6947e38, 0.499),  # 3.396e38: finite in float32, inf in bfloat16
])
def test_a_narrow_grad_that_overflows_only_when_rounded_back_is_caught(dtype, value, scale):
    g = {"w": torch.tensor([value, 1.0], dtype=dtype)}
    ls = fmp.StaticLossScale(scale)
    _, ok = ls.unscale_and_check(g)
    assert not bool(ok)
    # converted to float32 first (a compute copy's grad), the same value is finite
    _, ok32 = ls.unscale_and_check(g, like={"w": torch.zeros(2)})
    assert bool(ok32)


def test_float32_overflow_from_unscaling_and_nan_are_caught():
    ls = fmp.StaticLossScale(2.0**-10)
    assert not bool(ls.unscale_and_check({"w": torch.tensor([3.0e38])})[1])
    assert bool(ls.unscale_and_check({"w": torch.tensor([3.0e35])})[1])
    assert not bool(fmp.NoOpLossScale().unscale_and_check(
        {"a": torch.ones(2), "b": torch.tensor([math.nan])})[1])
    # float64 leaves keep float64's range
    assert bool(ls.unscale_and_check({"w": torch.tensor([3.0e38], dtype=torch.float64)})[1])


def test_trees_the_read_cannot_take_get_all_finite_itself():
    ls = fmp.StaticLossScale(2.0)
    with pytest.raises(TypeError, match="complex"):
        ls.unscale_and_check({"w": torch.ones(2, dtype=torch.complex64)})
    out, ok = ls.unscale_and_check({"n": 3, "e": torch.ones(0)})
    assert bool(ok) and out["n"] == 3
    # a non-tensor leaf first in the tree's order, then only empty tensors
    out, ok = ls.unscale_and_check({"a": 3, "e": torch.ones(0)})
    assert bool(ok) and ok.dtype == torch.bool and out["a"] == 3
