"""``adapters.apex.optimizers`` against torch.optim and float64 references of Apex's kernels.

Apex documents FusedAdam as a drop-in for ``torch.optim.AdamW`` (``adam_w_mode=True``, the
default) or ``torch.optim.Adam`` with L2 (``adam_w_mode=False``), and FusedSGD for
``torch.optim.SGD``; LAMB and NovoGrad are checked against the formulas of Apex's
``multi_tensor_lamb`` / ``multi_tensor_novograd`` kernels, computed in float64.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import blobs, mlp

from adapters.apex._warn import ApexArgumentWarning
from adapters.apex.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

STEPS = 5


def _grads(model, seed):
    x, y = blobs(32, seed=seed)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


def _run_pair(make_ours, make_ref, steps=STEPS):
    """Train two identical MLPs, one per optimizer, on the same batches; yield per step."""
    a, b = mlp(seed=0), mlp(seed=0)
    oa, ob = make_ours(a.parameters()), make_ref(b.parameters())
    out = []
    for i in range(steps):
        _grads(a, i)
        _grads(b, i)
        oa.step()
        ob.step()
        out.append((a.state_dict(), b.state_dict()))
    return out, (a, oa), (b, ob)


def _bit_equal(sa, sb):
    return all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- FusedAdam ------------------------------------------------------------------------

def test_fused_adam_default_equals_adamw_step_by_step():
    out, _, _ = _run_pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                          lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1,
                                                      foreach=True))
    assert all(_bit_equal(a, b) for a, b in out)
    out, _, _ = _run_pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                          lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    for a, b in out:  # the for-loop AdamW: the same up to rounding
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


def test_fused_adam_l2_mode_equals_adam_with_weight_decay():
    out, _, _ = _run_pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                          lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1,
                                                     foreach=True))
    assert all(_bit_equal(a, b) for a, b in out)
    # and it is not AdamW: the two modes part from the first step
    out, _, _ = _run_pair(lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                          lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1), steps=1)
    assert not _bit_equal(*out[0])


def _apex_adam64(p, g, m, v, lr, b1, b2, eps, t, wd, adamw, bias_correction=True):
    if not adamw:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
    u = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adamw:
        u = u + wd * p
    return p - lr * u, m, v


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_against_apex_kernel_formulas_in_float64(adamw, bias_correction):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    opt = FusedAdam([w], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
                    adam_w_mode=adamw, bias_correction=bias_correction)
    p, m, v = w.detach().double().clone(), torch.zeros(3, 4).double(), torch.zeros(3, 4).double()
    for t in range(1, STEPS + 1):
        g = torch.randn(3, 4)
        w.grad = g.clone()
        opt.step()
        p, m, v = _apex_adam64(p, g.double(), m, v, 1e-2, 0.8, 0.95, 1e-6, t, 0.05, adamw,
                               bias_correction)
        torch.testing.assert_close(w.detach().double(), p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-9)


def test_fused_adam_without_bias_correction_mixes_with_corrected_groups():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([{"params": [a]}, {"params": [b], "bias_correction": False}], lr=0.1)
    a.grad, b.grad = torch.full((2,), 0.5), torch.full((2,), 0.5)
    opt.step()
    assert a.detach().tolist() == pytest.approx([0.9, 0.9], abs=1e-6)  # m_hat/sqrt(v_hat)=1
    # uncorrected: m = 0.05, sqrt(v) = sqrt(0.001 * 0.25): step = 0.1 * 0.05 / 0.0158...
    want = 1 - 0.1 * 0.05 / (math.sqrt(0.001 * 0.25) + 1e-8)
    assert b.detach().tolist() == pytest.approx([want, want], abs=1e-6)


def test_fused_adam_resumes_from_an_apex_checkpoint_with_a_step_per_group():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(4)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as saved to disk
    apex_sd = {"state": {k: {n: t for n, t in s.items() if n != "step"}
                         for k, s in sd["state"].items()},
               "param_groups": [{**g, "step": 3} for g in sd["param_groups"]]}
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = FusedAdam([w2], lr=1e-2)
    opt2.load_state_dict(apex_sd)
    g = torch.randn(4)
    w.grad, w2.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2)


def test_fused_adam_apex_errors_and_warnings():
    p = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    opt = FusedAdam(p)
    with pytest.raises(RuntimeError, match="takes only a closure"):
        opt.step(scale=128.0)
    with pytest.warns(ApexArgumentWarning, match="master_weights=True has no torch "
                                                 "equivalent; the params are updated in"):
        FusedAdam(p, master_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedAdam(p, lr=1e-3, capturable=False)  # Apex's usual arguments: no warning


def test_set_grad_none_defaults_as_apex():
    w = torch.nn.Parameter(torch.ones(1))
    for opt, want_none in [(FusedAdam([w]), True), (FusedLAMB([w]), True),
                           (FusedNovoGrad([w]), True), (FusedSGD([w], lr=0.1), False),
                           (FusedAdam([w], set_grad_none=False), False)]:
        w.grad = torch.ones(1)
        opt.zero_grad()
        assert (w.grad is None) == want_none, type(opt).__name__
        if not want_none:
            assert w.grad.item() == 0.0


# ---- FusedSGD -------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True},
                                {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
                                {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}])
def test_fused_sgd_equals_torch_sgd(kw):
    out, _, _ = _run_pair(lambda p: FusedSGD(p, lr=0.1, **kw),
                          lambda p: torch.optim.SGD(p, lr=0.1, foreach=True, **kw))
    assert all(_bit_equal(a, b) for a, b in out)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_wd_after_momentum_against_apex_kernel_formulas(nesterov):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = FusedSGD([w], lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=nesterov,
                   wd_after_momentum=True)
    p, buf = w.detach().double().clone(), None
    for _ in range(STEPS):
        g = torch.randn(5)
        w.grad = g.clone()
        opt.step()
        g = g.double()
        buf = g.clone() if buf is None else 0.9 * buf + g
        d = g + 0.9 * buf if nesterov else buf
        p = p - 0.1 * (d + 0.05 * p)  # the decay after the momentum
        torch.testing.assert_close(w.detach().double(), p, rtol=1e-6, atol=1e-7)


def test_fused_sgd_apex_errors_and_warnings():
    p = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(ValueError, match="lr is required"):
        FusedSGD(p)
    with pytest.raises(ValueError, match="nesterov=True requires momentum > 0"):
        FusedSGD(p, lr=0.1, nesterov=True)
    with pytest.warns(ApexArgumentWarning, match="materialize_master_grads=False"):
        FusedSGD(p, lr=0.1, materialize_master_grads=False)


# ---- FusedLAMB ------------------------------------------------------------------------

def _lamb64(groups, state, max_grad_norm, adamw, grad_averaging, use_nvlamb):
    """Apex's LAMB on float64 copies, in place: groups = [(params, grads, hyper)]."""
    gnorm = math.sqrt(sum(float(g.double().square().sum()) for _, gs, _ in groups for g in gs))
    clip = gnorm / max_grad_norm if gnorm > max_grad_norm else 1.0
    for k, (ps, gs, h) in enumerate(groups):
        h["step"] += 1
        b1, b2 = h["betas"]
        t, wd, lr = h["step"], h["weight_decay"], h["lr"]
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        b3 = 1 - b1 if grad_averaging else 1.0
        for i, (p, g) in enumerate(zip(ps, gs, strict=True)):
            st = state.setdefault((k, i), {"m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            g = g.double() / clip
            if not adamw:
                g = g + wd * p
            st["m"] = b1 * st["m"] + b3 * g
            st["v"] = b2 * st["v"] + (1 - b2) * g * g
            u = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + h["eps"])
            if adamw:
                u = u + wd * p
            ratio = lr
            pn, un = float(p.norm()), float(u.norm())
            if (use_nvlamb or wd != 0) and pn != 0 and un != 0:
                ratio = lr * pn / un
            ps[i] = p - ratio * u


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_averaging", [True, False])
@pytest.mark.parametrize("use_nvlamb", [False, True])
@pytest.mark.parametrize("max_grad_norm", [1.0, 100.0])
def test_fused_lamb_against_a_float64_reference(adamw, grad_averaging, use_nvlamb,
                                                max_grad_norm):
    model = mlp(seed=1)
    decay = [model[0].weight, model[2].weight]
    no_decay = [model[0].bias, model[2].bias]
    opt = FusedLAMB([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                    lr=5e-2, adam_w_mode=adamw, grad_averaging=grad_averaging,
                    use_nvlamb=use_nvlamb, max_grad_norm=max_grad_norm)
    ref = [[p.detach().double().clone() for p in decay],
           [p.detach().double().clone() for p in no_decay]]
    hyper = [{"step": 0, "betas": (0.9, 0.999), "eps": 1e-6, "lr": 5e-2, "weight_decay": wd}
             for wd in (0.01, 0.0)]
    state: dict = {}
    clipped = []
    for i in range(STEPS):
        _grads(model, i)
        grads = [[p.grad.clone() for p in decay], [p.grad.clone() for p in no_decay]]
        clipped.append(math.sqrt(sum(float(g.square().sum()) for gs in grads for g in gs))
                       > max_grad_norm)
        opt.step()
        _lamb64([(ref[k], grads[k], hyper[k]) for k in range(2)], state, max_grad_norm,
                adamw, grad_averaging, use_nvlamb)
        for got, want in zip(decay + no_decay, ref[0] + ref[1], strict=True):
            torch.testing.assert_close(got.detach().double(), want, rtol=2e-5, atol=2e-6)
    assert any(clipped) == (max_grad_norm == 1.0)  # the clipping branch is exercised
    assert opt.param_groups[0]["step"] == STEPS  # Apex's layout: one step per group


def test_fused_lamb_trust_ratio_is_lr_times_the_norms_ratio():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # |w| = 5
    opt = FusedLAMB([w], lr=0.1, weight_decay=0.0, use_nvlamb=True, max_grad_norm=0)
    w.grad = torch.tensor([1.0, 0.0])
    opt.step()
    # first step: u = g/|g| elementwise = [1, 0] (m_hat = g, sqrt(v_hat) = |g|), |u| = 1
    assert w.detach().tolist() == pytest.approx([3.0 - 0.1 * 5.0, 4.0], abs=1e-5)
    w2 = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    opt2 = FusedLAMB([w2], lr=0.1, weight_decay=0.0, use_nvlamb=False)
    w2.grad = torch.tensor([1.0, 0.0])
    opt2.step()  # no decay and no nvlamb: plain lr
    assert w2.detach().tolist() == pytest.approx([3.0 - 0.1, 4.0], abs=1e-5)


def test_fused_lamb_float16_params_and_errors():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = FusedLAMB([w], lr=0.1)
    w.grad = torch.ones(4, dtype=torch.float16)
    opt.step()
    assert w.dtype == torch.float16 and opt.state[w]["exp_avg"].dtype == torch.float16
    assert torch.allclose(w.float(), torch.full((4,), 0.9), atol=1e-3)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB([w], amsgrad=True)
    d = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    d.grad = torch.ones(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"got torch\.float64"):
        FusedLAMB([d]).step()


# ---- FusedNovoGrad --------------------------------------------------------------------

@pytest.mark.parametrize("reg_inside_moment", [False, True])
@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("init_zero", [False, True])
def test_fused_novograd_against_a_float64_reference(reg_inside_moment, norm_type, init_zero):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6))
    lr, b1, b2, eps, wd = 1e-2, 0.95, 0.98, 1e-8, 1e-3
    opt = FusedNovoGrad([w], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                        reg_inside_moment=reg_inside_moment, norm_type=norm_type,
                        init_zero=init_zero)
    p, m, v = w.detach().double().clone(), torch.zeros(6).double(), None
    for t in range(1, STEPS + 1):
        g = torch.randn(6)
        w.grad = g.clone()
        opt.step()
        g = g.double()
        n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
        if v is None:
            v = 0.0 if init_zero else n
        v = math.sqrt(b2 * v * v + (1 - b2) * n * n) if norm_type == 2 else b2 * v + (1 - b2) * n
        denom = v / math.sqrt(1 - b2**t) + eps
        if reg_inside_moment:
            m = b1 * m + (1 - b1) * (g / denom + wd * p)
            p = p - lr * m / (1 - b1**t)
        else:
            m = b1 * m + (1 - b1) * g
            p = p - lr * ((m / (1 - b1**t)) / denom + wd * p)
        torch.testing.assert_close(w.detach().double(), p, rtol=1e-5, atol=1e-6)


def test_fused_novograd_rejects_other_norms():
    with pytest.raises(RuntimeError, match=r"norm_type 2 .* and 0 .*got 1"):
        FusedNovoGrad([torch.nn.Parameter(torch.ones(1))], norm_type=1)
