"""amp.init's handle unscales through the loss-scale record (no extra host sync), bit for bit."""

from __future__ import annotations

import pytest
import torch

import fmp
from adapters.apex.amp import _handle


def _old_unscale_check(scaler, params):
    # the handle's unscale before: a host float 1/scale, a foreach multiply, a check after
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        if grads:
            torch._foreach_mul_(grads, (1.0 / scaler.loss_scale.float()).item())
        finite = fmp.all_finite(grads) if grads else torch.tensor(True)
    ok = bool(finite.item())
    dynamic = isinstance(scaler, fmp.DynamicLossScale)
    return (scaler.adjust(finite) if dynamic else scaler), (dynamic and not ok)


def _params(dtype, bad, seed):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for shape in [(7,), (3, 5), (2, 2, 3)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3e3).to(dtype)
        ps.append(p)
    ps.append(torch.nn.Parameter(torch.zeros(2, dtype=dtype)))  # no grad
    if bad is not None:
        ps[1].grad[1, 2] = bad
    return ps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
@pytest.mark.parametrize("scale", ["dynamic", 128.0, 3.0])
def test_unscale_check_is_bit_equal_to_the_old_one(dtype, bad, scale):
    a, b, raw = _params(dtype, bad, 0), _params(dtype, bad, 0), _params(dtype, bad, 0)
    s_new, skip_new = _handle._unscale_check(_handle._scaler(scale), a)
    s_old, skip_old = _old_unscale_check(_handle._scaler(scale), b)
    assert skip_new == skip_old == (scale == "dynamic" and bad is not None)
    assert torch.equal(s_new.loss_scale, s_old.loss_scale)
    inv = torch.tensor(1 / (2.0**16 if scale == "dynamic" else scale), dtype=torch.float32)
    for p, q, r in zip(a, b, raw, strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is None:
            continue
        assert p.grad.dtype == dtype
        # the correctly rounded product with the float32 reciprocal, as torch.amp's kernel
        ref = (r.grad.double() * inv.double()).to(dtype)
        assert torch.equal(p.grad.view(torch.uint8), ref.view(torch.uint8))
        if dtype == torch.float32 or scale != 3.0:
            # bit for bit the old foreach multiply (which, on low-precision CPU grads,
            # rounded the reciprocal itself: off for a scale that is no power of two)
            assert torch.equal(p.grad.view(torch.uint8), q.grad.view(torch.uint8))


def test_unscale_check_without_grads_keeps_the_scale():
    s, skip = _handle._unscale_check(_handle._scaler("dynamic"),
                                     [torch.nn.Parameter(torch.zeros(2))])
    assert not skip and float(s.loss_scale) == 2.0**16
