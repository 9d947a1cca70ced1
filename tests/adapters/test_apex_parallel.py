"""``adapters.apex.parallel`` in one process: LARC against a hand computation, and
``convert_syncbn_model`` / ``SyncBatchNorm`` against the batch norms they replace.
(The multi-rank behaviour is in tests/distributed/test_apex_parallel_distributed.py.)"""

from __future__ import annotations

import pytest
import torch
from resnet_tiny import TinyResNet

from adapters.apex import parallel
from adapters.apex.fp16_utils import FP16_Optimizer
from adapters.apex.parallel import SyncBatchNorm, convert_syncbn_model
from adapters.apex.parallel.LARC import LARC


def _larc_by_hand(p, g, lr, wd, tc, clip, eps=1e-8):
    p, g = p.double(), g.double()
    pn, gn = p.norm().item(), g.norm().item()
    if pn == 0 or gn == 0:
        return p - lr * g  # no factor and no decay
    local = tc * pn / (gn + pn * wd + eps)
    factor = min(local / lr, 1.0) if clip else local
    return p - lr * (g + wd * p) * factor


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("tc", [0.02, 5.0])  # 5.0: clip mode caps the local lr at lr
def test_larc_against_a_hand_computation(clip, tc):
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3)),
          torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.randn(2))]
    grads = [torch.randn(4, 3), torch.randn(3) * 1e-3, torch.randn(2), torch.zeros(2)]
    want = [_larc_by_hand(w.detach(), g, 0.1, 1e-2, tc, clip) for w, g in zip(ws, grads,
                                                                              strict=True)]
    opt = LARC(torch.optim.SGD(ws, lr=0.1, weight_decay=1e-2), trust_coefficient=tc, clip=clip)
    for w, g in zip(ws, grads, strict=True):
        w.grad = g.clone()
    opt.step()
    for w, ref in zip(ws, want, strict=True):
        torch.testing.assert_close(w.detach().double(), ref, rtol=1e-6, atol=1e-7)
    assert opt.param_groups[0]["weight_decay"] == 1e-2  # restored after the inner step
    w0, g0 = ws[0].detach().double(), grads[0].double()
    local = tc * w0.norm() / (g0.norm() + 1e-2 * w0.norm())
    assert (local > 0.1) == (tc == 5.0)  # both sides of the clip are exercised


def test_larc_clip_caps_the_step_at_the_optimizers_lr():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # |w| = 5
    opt = LARC(torch.optim.SGD([w], lr=0.1), trust_coefficient=1.0)  # local lr 5/|g|
    w.grad = torch.tensor([0.0, 1.0])  # local lr 5 > 0.1: plain SGD at lr
    opt.step()
    assert w.detach().tolist() == pytest.approx([3.0, 3.9])
    w.grad = torch.tensor([0.0, 100.0])  # local lr 0.0499 < 0.1: the step is 0.0499 * g
    before = w.detach().clone()
    opt.step()
    local = 1.0 * before.norm().item() / 100.0
    assert w.detach().tolist() == pytest.approx([3.0, 3.9 - local * 100.0], rel=1e-6)


def test_larc_behaves_as_the_optimizer_it_wraps():
    w = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt = LARC(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    w.grad = torch.ones(2)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["momentum_buffer"] is not None
    opt.zero_grad()
    assert w.grad is None
    opt.load_state_dict(sd)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    assert len(inner.param_groups) == 2


def test_larc_inside_fp16_optimizer():
    model = torch.nn.Linear(4, 2).half()
    opt = FP16_Optimizer(LARC(torch.optim.SGD(model.parameters(), lr=0.1)),
                         dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 16.0})
    before = model.weight.detach().clone()
    opt.backward(model(torch.ones(3, 4, dtype=torch.half)).float().sum())
    opt.step()
    assert not opt.overflow and not torch.equal(before, model.weight.detach())


# ---- SyncBatchNorm ----------------------------------------------------------------------

def _trained_bn():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4, eps=1e-3, momentum=0.2)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn(torch.randn(8, 4, 3, 3))  # running stats away from their initial values
    return bn


def test_convert_syncbn_model_keeps_statistics_and_affine_params():
    model = TinyResNet()
    ref = TinyResNet()
    ref.load_state_dict(model.state_dict())
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    converted = convert_syncbn_model(model)
    new = [m for m in converted.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(new) == len(bns) and all(isinstance(m, torch.nn.SyncBatchNorm) for m in new)
    assert all(isinstance(m, SyncBatchNorm) for m in new)
    for old, m in zip(bns, new, strict=True):
        assert m.running_mean is old.running_mean and m.running_var is old.running_var
        assert torch.equal(m.weight, old.weight) and m.weight is not old.weight
        assert (m.eps, m.momentum, m.affine) == (old.eps, old.momentum, old.affine)
    x = torch.randn(4, 3, 16, 16)
    assert torch.equal(converted(x), ref(x))  # one process: the same batch norm
    for a, b in zip(converted.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_convert_a_trained_batchnorm_directly():
    bn = _trained_bn()
    ref = _trained_bn()
    sbn = convert_syncbn_model(bn, channel_last=True)
    assert isinstance(sbn, SyncBatchNorm) and sbn.channel_last
    assert int(sbn.num_batches_tracked) == 1
    sbn.eval()
    ref.eval()
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(sbn(x.permute(0, 2, 3, 1)), ref(x).permute(0, 2, 3, 1))


def test_syncbatchnorm_residual_and_fused_relu():
    sbn = SyncBatchNorm(4, fuse_relu=True)
    bn = torch.nn.BatchNorm1d(4)
    x, z = torch.randn(6, 4), torch.randn(6, 4)
    assert torch.equal(sbn(x, z), torch.relu(bn(x) + z))


def test_create_syncbn_process_group_zero_is_the_world():
    assert parallel.create_syncbn_process_group(0) is None
