"""Groups a Fused* optimizer updates with its own code follow torch's amp protocol.

torch's fused kernels read ``optimizer.grad_scale`` / ``optimizer.found_inf`` (set by
``torch.amp.GradScaler`` and by amp O1/O2 on CUDA, where the skip is left to the kernel).
FusedAdam(bias_correction=False) and FusedSGD(wd_after_momentum=True) update such groups
themselves: they must skip on ``found_inf`` and unscale by ``grad_scale`` as well. Found on
the H200: amp O2 + FusedAdam(bias_correction=False) applied a NaN step to the masters.
"""

from __future__ import annotations

import copy

import pytest
import torch

from adapters.apex import amp
from adapters.apex.optimizers import FusedAdam, FusedSGD

MAKERS = {
    "adam_no_bias_correction": lambda ps: FusedAdam(ps, lr=0.1, bias_correction=False,
                                                    weight_decay=0.01),
    "sgd_wd_after_momentum": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01,
                                                 wd_after_momentum=True),
}


def _params(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g).to(device)),
            torch.nn.Parameter(torch.randn(3, generator=g).to(device))]


def _grads(ps, factor=1.0):
    g = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.device) * factor


def _state(opt):
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in enumerate(opt.state.values())}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_found_inf_skips_the_own_groups_exactly(kind):
    ps = _params()
    opt = MAKERS[kind](ps)
    _grads(ps)
    opt.step()  # one real step first: state exists
    _grads(ps, 2.0)
    before, state = [p.detach().clone() for p in ps], _state(opt)
    opt.found_inf, opt.grad_scale = torch.ones(()), None
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))
    assert _state(opt).keys() == state.keys()
    for i, s in state.items():
        for k, v in s.items():
            got = _state(opt)[i][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v
    opt.found_inf = torch.zeros(())
    ref_ps = [torch.nn.Parameter(b.clone()) for b in before]
    ref = MAKERS[kind](ref_ps)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    for r, p in zip(ref_ps, ps, strict=True):
        r.grad = p.grad.clone()
    opt.step()
    ref.step()
    assert all(torch.equal(p, r) for p, r in zip(ps, ref_ps, strict=True))


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_grad_scale_unscales_for_the_update_only(kind):
    ps, ref_ps = _params(), _params()
    opt, ref = MAKERS[kind](ps), MAKERS[kind](ref_ps)
    _grads(ref_ps)
    _grads(ps, 1024.0)
    held = [p.grad for p in ps]
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.zeros(())
    opt.step()
    ref.step()
    for p, r in zip(ps, ref_ps, strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-7)
    assert all(p.grad is g for p, g in zip(ps, held, strict=True))  # the user's grads stay


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_amp_o2_skip_on_cuda_leaves_masters_and_state(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1)).cuda()
    opt = MAKERS[kind](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic",
                                verbosity=0)
    x = torch.randn(16, 8, device="cuda")
    for _ in range(2):
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    halves = [p.detach().clone() for p in model.parameters()]
    state = _state(opt)
    bad = x.clone()
    bad[0, 0] = float("inf")
    with amp.scale_loss(model(bad).float().pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    assert amp.last_step_skipped()
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), masters,
                                                 strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), halves,
                                                 strict=True))
    for i, s in state.items():
        for k, v in s.items():
            got = _state(opt)[i][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v
