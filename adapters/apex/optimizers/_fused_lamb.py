"""``apex.optimizers.FusedLAMB``: LAMB as Apex computed it, on torch foreach ops.

torch has no LAMB; this follows Apex's ``multi_tensor_lamb`` kernel:

1. the global grad norm ``G`` over every param of every group; when
   ``G > max_grad_norm`` the grads are divided by ``G / max_grad_norm``;
2. Adam moments of the clipped grad ``g`` (``grad_averaging``: ``m`` mixes in
   ``(1 - beta1) * g``, else ``g``), with weight decay either inside the grad
   (``adam_w_mode=False``: ``g + wd * p``) or added to the update
   (``adam_w_mode=True``: ``u = m_hat / (sqrt(v_hat) + eps) + wd * p``);
3. the trust ratio ``||p|| / ||u||`` scales the step ``lr`` (only for groups with
   weight decay unless ``use_nvlamb``; 1 where either norm is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adapters.apex.optimizers._common import materialize


def _norms(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts])


class FusedLAMB(torch.optim.Optimizer):
    """Apex's FusedLAMB (LAMB, arXiv:1904.00962), on CPU and CUDA.

    The state is Apex's: ``exp_avg``/``exp_avg_sq`` per param (in the param's dtype), one
    ``step`` per group; the math is float32. Unlike Apex, the grads are left as they
    are (Apex's kernel overwrote ``.grad`` with the update).

    Args:
        params: params or param groups.
        lr: learning rate (1e-3).
        bias_correction: Adam's bias correction (True).
        betas: moment coefficients ((0.9, 0.999)).
        eps: added to the denominator (1e-6).
        weight_decay: weight decay (0.01).
        amsgrad: must be False, as in Apex.
        adam_w_mode: decoupled weight decay (True) or L2 inside the moments.
        grad_averaging: ``m`` mixes in ``(1 - beta1) * g`` (True) or ``g``.
        set_grad_none: ``zero_grad()`` sets grads to None (True).
        max_grad_norm: clip the global grad norm to this (1.0; 0 or None: no clipping).
        use_nvlamb: apply the trust ratio to groups without weight decay too (False).

    Raises:
        RuntimeError: ``amsgrad=True``, a sparse grad, or a param neither float16,
            bfloat16 nor float32.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> opt = FusedLAMB([w], lr=0.1)
        >>> w.grad = torch.ones(4); opt.step()
        >>> [round(x, 4) for x in w.tolist()]  # the step is lr * ||w|| in norm
        [0.9, 0.9, 0.9, 0.9]
    """

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float | None = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(materialize(params), defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the grads; ``set_to_none`` defaults to the ``set_grad_none`` given."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _with_grads(self, group: dict[str, Any]) -> list[torch.Tensor]:
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedLAMB does not support sparse gradients")
            if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise RuntimeError(f"FusedLAMB supports float16, bfloat16 and float32 "
                                   f"params, got {p.dtype}")
            out.append(p)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step over every group; ``closure`` as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = [self._with_grads(g) for g in self.param_groups]
        every = [p for ps in per_group for p in ps]
        if not every:
            return loss
        gnorm = _norms([p.grad for p in every]).square().sum().sqrt()
        max_norm = self.defaults["max_grad_norm"]
        if max_norm:
            clip = torch.where(gnorm > max_norm, gnorm / max_norm, torch.ones_like(gnorm))
        else:
            clip = torch.ones_like(gnorm)
        for group, ps in zip(self.param_groups, per_group, strict=True):
            group["step"] = group.get("step", 0) + 1
            if ps:
                self._update(group, ps, clip.to(ps[0].device))
        return loss

    def _update(self, group: dict[str, Any], ps: list[torch.Tensor], clip: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        step, wd, lr = group["step"], group["weight_decay"], group["lr"]
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        for p in ps:
            st = self.state[p]
            if not st:
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
        p32 = [p.float() for p in ps]
        g = torch._foreach_div([p.grad.float() for p in ps], clip)
        if self.adam_w_mode == 0 and wd != 0:
            torch._foreach_add_(g, p32, alpha=wd)
        m = torch._foreach_mul([self.state[p]["exp_avg"].float() for p in ps], beta1)
        torch._foreach_add_(m, g, alpha=beta3)
        v = torch._foreach_mul([self.state[p]["exp_avg_sq"].float() for p in ps], beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_sqrt(torch._foreach_div(v, bc2))
        torch._foreach_add_(denom, group["eps"])
        u = torch._foreach_div(torch._foreach_div(m, bc1), denom)
        if self.adam_w_mode == 1 and wd != 0:
            torch._foreach_add_(u, p32, alpha=wd)
        lr_t = torch.full((len(ps),), float(lr), device=ps[0].device)
        if self.use_nvlamb or wd != 0:
            pn, un = _norms(p32), _norms(u)
            lr_t = torch.where((pn != 0) & (un != 0), lr_t * pn / un, lr_t)
        for i, p in enumerate(ps):
            p.copy_(p32[i] - lr_t[i] * u[i])
            self.state[p]["exp_avg"].copy_(m[i])
            self.state[p]["exp_avg_sq"].copy_(v[i])
