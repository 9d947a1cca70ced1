"""``adapters.apex.amp_C`` through ``multi_tensor_applier``: Apex's kernel semantics.

Apex's convention: ``noop_flag`` is a one-element int tensor the kernels set to 1 on an
inf/NaN in what they check and never reset; scale/axpby still write their outputs.
"""

from __future__ import annotations

import pytest
import torch

from adapters.apex import amp_C
from adapters.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

INF, NAN = float("inf"), float("nan")


def flag():
    return torch.zeros(1, dtype=torch.int)


def test_applier_passes_apex_chunk_size_and_is_available():
    seen = []
    multi_tensor_applier(lambda *a: seen.append(a), "buf", "lists", 1, 2)
    assert seen == [(2048 * 32, "buf", "lists", 1, 2)]
    assert multi_tensor_applier.available and MultiTensorApply.available


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scale_writes_and_casts_to_the_outputs(dtype):
    ins = [torch.tensor([1.0, -2.0], dtype=dtype), torch.arange(6.0).reshape(2, 3).to(dtype)]
    outs = [torch.empty(2), torch.empty(2, 3)]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [ins, outs], 0.25)
    assert buf.item() == 0
    for i, o in zip(ins, outs, strict=True):
        assert o.dtype == torch.float32
        assert torch.equal(o, i.float() * 0.25)


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_scale_sets_the_flag_on_a_nonfinite_input_and_keeps_it(bad):
    ins = [torch.ones(3), torch.tensor([1.0, bad])]
    outs = [torch.empty(3), torch.empty(2)]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [ins, outs], 2.0)
    assert buf.item() == 1
    assert torch.equal(outs[0], torch.full((3,), 2.0))  # written anyway, as Apex
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [[torch.ones(1)], [torch.empty(1)]], 1.0)
    assert buf.item() == 1  # never reset by a kernel


def test_fp16_max_is_finite_not_an_overflow():
    buf = flag()
    big = torch.full((4,), 65504.0, dtype=torch.float16)
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [[big], [torch.empty(4)]], 1.0)
    assert buf.item() == 0


def test_l2norm_total_and_per_tensor():
    ts = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.float16)]
    buf = flag()
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [ts], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    assert total.item() == 13.0 and per.tolist() == [5.0, 12.0]
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [ts], False)
    assert per.shape == (0,) and total.item() == 13.0
    assert buf.item() == 0
    # fp16 values whose squares overflow fp16 still give the right float32 norm
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf,
                                    [[torch.full((4,), 60000.0, dtype=torch.float16)]])
    assert total.item() == 120000.0 and buf.item() == 0


@pytest.mark.parametrize("bad", [INF, NAN])
def test_l2norm_sets_the_flag(bad):
    buf = flag()
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf,
                                    [[torch.ones(2), torch.tensor([bad])]], False)
    assert buf.item() == 1 and not torch.isfinite(total).all()


def test_axpby_values_and_which_argument_is_checked():
    x, y = [torch.tensor([1.0, 2.0])], [torch.tensor([10.0, 20.0])]
    out = [torch.empty(2)]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [x, y, out], 2.0, 0.5, -1)
    assert out[0].tolist() == [7.0, 14.0] and buf.item() == 0
    bad = [torch.tensor([INF, 1.0])]
    for check, lists, want in [(0, [x, bad, out], 0), (1, [x, bad, out], 1),
                               (-1, [bad, y, out], 1), (1, [bad, y, out], 0)]:
        buf = flag()
        multi_tensor_applier(amp_C.multi_tensor_axpby, buf, lists, 1.0, 1.0, check)
        assert buf.item() == want, check
    with pytest.raises(ValueError, match="arg_to_check must be -1, 0 or 1, got 2"):
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag(), [x, y, out], 1.0, 1.0, 2)


def test_mismatched_lists_are_a_clear_error():
    with pytest.raises(ValueError, match="must hold 2 lists"):
        multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [[torch.ones(1)]], 1.0)
    with pytest.raises(ValueError, match="differ in length"):
        multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [[torch.ones(1)], []], 1.0)


def _adam_ref(g, p, m, v, lr, b1, b2, eps, step, mode, wd):
    g, p, m, v = (t.double() for t in (g, p, m, v))
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if mode == 1:
        u = u + wd * p
    return p - lr * u, m, v


@pytest.mark.parametrize("mode", [0, 1])
def test_adam_kernel_against_a_float64_reference(mode):
    torch.manual_seed(0)
    p, m, v = torch.randn(5), torch.zeros(5), torch.zeros(5)
    rp, rm, rv = p.double(), m.double(), v.double()
    for step in range(1, 4):
        g = torch.randn(5)
        multi_tensor_applier(amp_C.multi_tensor_adam, flag(), [[g], [p], [m], [v]],
                             1e-2, 0.9, 0.99, 1e-8, step, mode, 1, 0.1)
        rp, rm, rv = _adam_ref(g, rp, rm, rv, 1e-2, 0.9, 0.99, 1e-8, step, mode, 0.1)
    torch.testing.assert_close(p.double(), rp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v.double(), rv, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd_after", [False, True])
def test_sgd_kernel_against_torch_sgd_and_the_noop_flag(nesterov, wd_after):
    torch.manual_seed(0)
    p = torch.randn(4)
    ref = p.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    m = torch.zeros(4)
    for i in range(3):
        g = torch.randn(4)
        multi_tensor_applier(amp_C.multi_tensor_sgd, flag(), [[g], [p], [m]],
                             0.01, 0.9, 0.0, 0.1, nesterov, i == 0, wd_after, 1.0)
        ref.grad = g.clone()
        opt.step()
    if not wd_after:
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
    else:
        assert not torch.allclose(p, ref.detach(), atol=1e-7)
    before = (p.clone(), m.clone())
    half = torch.zeros(4, dtype=torch.float16)
    buf = torch.ones(1, dtype=torch.int)  # already set: the kernel does nothing
    multi_tensor_applier(amp_C.multi_tensor_sgd, buf, [[torch.ones(4)], [p], [m], [half]],
                         0.0, 0.9, 0.0, 0.1, nesterov, False, wd_after, 1.0)
    assert torch.equal(p, before[0]) and torch.equal(m, before[1])
    assert torch.equal(half, torch.zeros(4, dtype=torch.float16))
    multi_tensor_applier(amp_C.multi_tensor_sgd, flag(), [[torch.ones(4)], [p], [m], [half]],
                         0.0, 0.9, 0.0, 0.1, nesterov, False, wd_after, 0.5)
    assert torch.equal(half, p.half()) and not torch.equal(p, before[0])


def _hyst(scale, growth, hyst, found, interval=3, h=2):
    s = torch.tensor([scale])
    g = torch.tensor([growth], dtype=torch.int32)
    t = torch.tensor([hyst], dtype=torch.int32)
    out = amp_C.update_scale_hysteresis(s, g, t, torch.tensor([found]), 2.0, 0.5, interval, h)
    assert out is s
    return s.item(), g.item(), t.item()


def test_update_scale_hysteresis_cases():
    assert _hyst(8.0, 1, 2, 1.0) == (8.0, 0, 1)  # first inf tolerated
    assert _hyst(8.0, 1, 1, 1.0) == (4.0, 0, 0)  # hysteresis used up: back off
    assert _hyst(8.0, 0, 0, 1.0) == (4.0, 0, -1)  # stays exhausted until a clean step
    assert _hyst(8.0, 0, 1, 0.0) == (8.0, 1, 2)  # clean: count, refill hysteresis
    assert _hyst(8.0, 2, 1, 0.0) == (16.0, 0, 2)  # interval reached: grow
    big = torch.finfo(torch.float32).max
    assert _hyst(big, 2, 2, 0.0)[:2] == (big, 0)  # growth past float32 is refused
