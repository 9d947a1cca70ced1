"""The CUDA paths of the Apex extras (skip without a GPU): FusedAdam/FusedSGD pick torch's
fused kernels and equal torch's fused AdamW/SGD; amp_C kernels and LAMB on CUDA tensors;
SyncBatchNorm on one GPU is a batch norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import blobs, mlp

from adapters.apex import amp_C
from adapters.apex.multi_tensor_apply import multi_tensor_applier
from adapters.apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
from adapters.apex.parallel import convert_syncbn_model

pytestmark = pytest.mark.cuda


def _pair(make_ours, make_ref, steps=5):
    a, b = mlp(seed=0).cuda(), mlp(seed=0).cuda()
    oa, ob = make_ours(a.parameters()), make_ref(b.parameters())
    x, y = (t.cuda() for t in blobs(32))
    for _ in range(steps):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    return a, b, oa


def test_fused_adam_is_torch_fused_adamw():
    a, b, opt = _pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                      lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True))
    assert opt.param_groups[0]["fused"]
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fused_sgd_is_torch_fused_sgd():
    a, b, opt = _pair(lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True),
                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                fused=True))
    assert opt.param_groups[0]["fused"]
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_amp_c_flag_on_cuda_and_lamb_trains():
    buf = torch.zeros(1, dtype=torch.int, device="cuda")
    out = [torch.empty(2, device="cuda")]
    multi_tensor_applier(amp_C.multi_tensor_scale, buf,
                         [[torch.tensor([1.0, float("nan")], device="cuda")], out], 2.0)
    assert buf.item() == 1
    m = mlp().cuda()
    opt = FusedLAMB(m.parameters(), lr=2e-2)
    x, y = (t.cuda() for t in blobs(256))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_syncbn_on_one_gpu_equals_batchnorm():
    bn = torch.nn.BatchNorm2d(4).cuda()
    sbn = convert_syncbn_model(torch.nn.BatchNorm2d(4)).cuda()
    x = torch.randn(8, 4, 5, 5, device="cuda")
    torch.testing.assert_close(sbn(x), bn(x))
    torch.testing.assert_close(sbn.running_var, bn.running_var)
