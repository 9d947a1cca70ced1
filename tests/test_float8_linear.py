"""Float8Linear's three float8 matmuls against float32 (CPU, and CUDA where marked).

The bound is elementwise and rigorous up to float32 accumulation: rounding to a float8
format moves a value v by at most u*|v| (u = 2**-4 for e4m3's 3 mantissa bits, 2**-3 for
e5m2's 2) or, below the normal range, by half the subnormal spacing divided by the scale
(2**-10 for e4m3, 2**-17 for e5m2). So for out = a @ b with errors ea, eb:
|out - a @ b| <= ea @ |b| + |a| @ eb + ea @ eb (+ float32 and output rounding).
"""

from __future__ import annotations

import pytest
import torch

import fmp
from fmp.float8 import Float8Linear, Recipe
from fmp.float8._cast import to_float8

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
U = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}
TOP = {"e4m3": 448.0, "e5m2": 57344.0}


def _err(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """The largest rounding error of each element of v under dynamic scaling to ``fmt``."""
    v = v.double()
    s = TOP[fmt] / v.abs().max()
    return torch.maximum(U[fmt] * v.abs(), torch.full_like(v, SUB[fmt]) / s)


def _bound(a, b, fmt_a, fmt_b, out_rel):
    """The bound on |fl8(a) @ fl8(b) - a @ b| (a: [M, K], b: [K, N])."""
    ea, eb = _err(a, fmt_a), _err(b, fmt_b)
    aa, ab = a.double().abs(), b.double().abs()
    ref = a.double() @ b.double()
    return ea @ ab + aa @ eb + ea @ eb + 1e-5 * (aa @ ab) + out_rel * ref.abs() * 1.01, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [32, 24])  # 24: the backward pads g.T @ x to 32
def test_forward_and_backward_within_the_float8_bound(device, dtype, rows):
    torch.manual_seed(0)
    x = (torch.randn(rows, 64, device=device) * 3).to(dtype)
    layer = Float8Linear(64, 48, bias=False, device=device, dtype=dtype, recipe="dynamic")
    g = (torch.randn(rows, 48, device=device) * 1e-3).to(dtype)
    xr = x.detach().requires_grad_()
    out = layer(xr)
    out.backward(g)
    out_rel = 0.0 if dtype == torch.float32 else 2.0 ** -8  # the bf16 output's rounding
    w = layer.weight.detach()
    for got, (a, b, fa, fb) in [
            (out, (x, w.t(), "e4m3", "e4m3")),
            (xr.grad, (g, w, "e5m2", "e4m3")),
            (layer.weight.grad, (g.t(), x, "e5m2", "e4m3"))]:
        assert got.dtype == dtype
        bound, ref = _bound(a.float(), b.float(), fa, fb, out_rel)
        err = (got.detach().double() - ref).abs()
        assert (err <= bound).all(), float((err - bound).max())
        rel = float(err.norm() / ref.norm())
        assert 1e-3 < rel < 0.15  # float8 was used (float32 would be ~1e-7), and it is close


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_is_the_product_of_the_dequantized_casts(device):
    torch.manual_seed(1)
    x = torch.randn(16, 32, device=device)
    layer = Float8Linear(32, 16, device=device)
    sx = 448.0 / x.abs().max()
    sw = 448.0 / layer.weight.detach().abs().max()
    xq = to_float8(x, sx, "e4m3").float() / sx
    wq = to_float8(layer.weight.detach(), sw, "e4m3").float() / sw
    # the reference in float64 on the CPU: the products of two e4m3 values are exact, and
    # only the sum's rounding is left. Hopper's float8 tensor cores accumulate in less than
    # float32 (a relative 3.5e-3 on an element with cancellation, seen on an H100), so the
    # bound is on the sum of |products|: 1e-3 of it, where the float8 casts themselves move
    # the result by about 3e-2 of it (a layer that skipped a cast fails)
    xq, wq = xq.cpu().double(), wq.cpu().double()
    want = xq @ wq.t() + layer.bias.detach().cpu().double()
    mag = xq.abs() @ wq.abs().t()
    got = layer(x).detach().cpu().double()
    assert ((got - want).abs() <= 1e-3 * mag + 1e-6).all()
    unquantized = x.cpu().double() @ layer.weight.detach().cpu().double().t()
    assert ((unquantized + layer.bias.detach().cpu().double() - want).abs()
            > 1e-3 * mag).any()


def test_convert_swaps_eligible_linears_keeping_params_and_names():
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                              torch.nn.Linear(8, 16))
    w0 = net[0].weight
    names = [n for n, _ in net.named_parameters()]
    out = fmp.float8.convert(net, Recipe("delayed", history=4))
    assert out is net
    assert [type(m).__name__ for m in net] == ["Float8Linear", "ReLU", "Linear", "Linear"]
    assert net[0].weight is w0 and [n for n, _ in net.named_parameters()] == names
    assert net[0].recipe == Recipe("delayed", history=4) and net[0].float8_name == "0"
    records = fmp.float8.init(net)
    assert list(records) == ["0"] and records["0"].history == 4


def test_convert_with_a_predicate_and_tied_weights():
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    net[1].weight = net[0].weight
    fmp.float8.convert(net, "dynamic", modules=lambda name, m: name == "1")
    assert [type(m).__name__ for m in net] == ["Linear", "Float8Linear"]
    assert net[1].weight is net[0].weight


def test_float8_linear_needs_multiples_of_16_and_float_inputs():
    with pytest.raises(ValueError, match="in_features=17 and out_features=16 must both be "
                                         "multiples of 16"):
        Float8Linear(17, 16)
    with pytest.raises(ValueError, match=r"the input is torch.float64"):
        Float8Linear(16, 16)(torch.ones(2, 16, dtype=torch.float64))


def test_outside_a_step_a_delayed_layer_scales_dynamically():
    torch.manual_seed(2)
    x = torch.randn(8, 16) * 1000  # scale 1 (a fresh record) would saturate at 448
    layer = Float8Linear(16, 16, recipe="delayed")
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        rel = float((layer(x) - ref).norm() / ref.norm())
    assert rel < 0.1  # saturating at 448 with the fresh record's scale 1 gives 0.64


def test_unsupported_gpu_is_a_clear_error(monkeypatch):
    from fmp.float8 import _linear

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")
    with pytest.raises(RuntimeError, match=r"capability 8.9 or newer.*has capability 8.0"):
        _linear.check_device(torch.device("cuda", 7))


@pytest.mark.cuda
def test_cuda_convert_checks_the_capability():
    net = torch.nn.Sequential(torch.nn.Linear(16, 16)).cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(RuntimeError, match=r"capability 8.9"):
            fmp.float8.convert(net)
    else:
        assert type(fmp.float8.convert(net)[0]).__name__ == "Float8Linear"
