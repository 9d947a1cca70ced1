"""``amp_C.multi_tensor_unscale_l2norm``: Apex's norm of unscaled grads (grads not written)."""

from __future__ import annotations

import pytest
import torch

from adapters.apex import amp_C
from adapters.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier


def flag(device="cpu"):
    return torch.zeros(1, dtype=torch.int, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_of_unscaled_values_and_inputs_untouched(dtype):
    a = torch.full((777,), 4.0, dtype=dtype)
    b = torch.full((555,), 4.0, dtype=dtype)
    ins = [a.clone(), b.clone(), a.clone()]
    before = [t.clone() for t in ins]
    buf = flag()
    total, per = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, buf, [ins],
                                      torch.tensor([0.5]), True)
    want = torch.full((777 + 555 + 777,), 2.0).norm()
    torch.testing.assert_close(total, want.reshape(1))
    torch.testing.assert_close(per, torch.stack([(a.float() * 0.5).norm(),
                                                 (b.float() * 0.5).norm(),
                                                 (a.float() * 0.5).norm()]))
    assert total.dtype == per.dtype == torch.float32 and total.shape == (1,)
    assert buf.item() == 0
    assert all(torch.equal(x, y) for x, y in zip(ins, before, strict=True))
    total2, per2 = MultiTensorApply(333)(amp_C.multi_tensor_unscale_l2norm, buf, [ins],
                                         torch.tensor([0.5]), False)
    assert torch.equal(total2, total) and per2.shape == (0,)


def test_scaled_fp16_grads_whose_squares_overflow():
    g = [torch.full((4,), 60000.0, dtype=torch.float16)]
    buf = flag()
    total, _ = amp_C.multi_tensor_unscale_l2norm(2048, buf, [g], torch.tensor([1 / 1024]))
    assert total.item() == pytest.approx(120000.0 / 1024) and buf.item() == 0


def test_number_inv_scale_is_accepted():
    buf = flag()
    total, _ = amp_C.multi_tensor_unscale_l2norm(0, buf, [[torch.tensor([6.0, 8.0])]], 0.5)
    assert total.item() == 5.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_sets_the_flag_and_keeps_it(bad):
    buf = flag()
    amp_C.multi_tensor_unscale_l2norm(0, buf, [[torch.ones(2), torch.tensor([bad])]],
                                      torch.tensor([1.0]))
    assert buf.item() == 1
    amp_C.multi_tensor_unscale_l2norm(0, buf, [[torch.ones(2)]], torch.tensor([1.0]))
    assert buf.item() == 1


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="1 list"):
        amp_C.multi_tensor_unscale_l2norm(0, flag(), [[torch.ones(1)], [torch.ones(1)]], 1.0)
    with pytest.raises(ValueError, match="empty"):
        amp_C.multi_tensor_unscale_l2norm(0, flag(), [[]], 1.0)
    with pytest.raises(ValueError, match="one element"):
        amp_C.multi_tensor_unscale_l2norm(0, flag(), [[torch.ones(1)]], torch.ones(2))


@pytest.mark.cuda
def test_cuda_matches_cpu():
    ts = [torch.randn(1000) * 1000, torch.randn(33) * 1000]
    inv = torch.tensor([1 / 65536.0])
    want, wper = amp_C.multi_tensor_unscale_l2norm(0, flag(), [ts], inv, True)
    buf = flag("cuda")
    got, per = amp_C.multi_tensor_unscale_l2norm(
        0, buf, [[t.cuda().half() for t in ts]], inv.cuda(), True)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=0)
    torch.testing.assert_close(per.cpu(), wper, rtol=1e-3, atol=0)
    assert buf.item() == 0
