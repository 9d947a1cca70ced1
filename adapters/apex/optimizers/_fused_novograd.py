"""``apex.optimizers.FusedNovoGrad``: NovoGrad as Apex computed it, on torch ops.

torch has no NovoGrad; this follows Apex's ``multi_tensor_novograd`` kernel. Each param
keeps a moving *norm* of its grad ``v`` (a scalar: L2 ``v = sqrt(b2 v^2 + (1-b2) |g|^2)``,
or max-abs ``v = b2 v + (1-b2) |g|``), started at the first grad's norm (or 0 with
``init_zero``); the grad is divided by ``v / sqrt(1 - b2^t) + eps``, in the momentum
(``reg_inside_moment=True``, with ``wd * p`` added there) or in the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from adapters.apex.optimizers._common import materialize


class FusedNovoGrad(torch.optim.Optimizer):
    """Apex's FusedNovoGrad (arXiv:1904.03288), on CPU and CUDA.

    The state: ``exp_avg`` per param and one ``step`` per group as in Apex; the moving
    grad norm is kept per param as ``exp_avg_sq`` (a float32 scalar), where Apex kept one
    tensor per group and dtype. Math in float32.

    Args:
        params: params or param groups.
        lr: learning rate (1e-3).
        bias_correction: bias correction (True).
        betas: coefficients ((0.9, 0.999)).
        eps: added to the denominator (1e-8).
        weight_decay: weight decay (0).
        amsgrad: must be False, as in Apex.
        reg_inside_moment: apply the norm and weight decay inside the momentum (False).
        grad_averaging: the momentum mixes in ``(1 - beta1) * g`` (True) or ``g``.
        norm_type: 2 (L2) or 0 (max-abs) per-param grad norm.
        init_zero: start the grad norm at 0 (True) or at the first grad's norm (False).
        set_grad_none: ``zero_grad()`` sets grads to None (True).

    Raises:
        RuntimeError: ``amsgrad=True``, a ``norm_type`` other than 0 and 2, or a sparse grad.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = FusedNovoGrad([w], lr=0.1)
        >>> w.grad = torch.full((2,), 3.0); opt.step()
        >>> [round(x, 3) for x in w.tolist()]  # 1 - 0.1 * 3 / (|g| / sqrt(1 - b2))
        [0.998, 0.998]
    """

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True
                 ) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant "
                               "(amsgrad=True)")
        if norm_type not in (0, 2):
            raise RuntimeError(f"FusedNovoGrad supports norm_type 2 (L2) and 0 (max-abs), "
                               f"got {norm_type!r}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(materialize(params), defaults)
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the grads; ``set_to_none`` defaults to the ``set_grad_none`` given."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One NovoGrad step; ``closure`` as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedNovoGrad does not support sparse gradients")
                self._update(group, p)
        return loss

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        step, wd, lr, eps = group["step"], group["weight_decay"], group["lr"], group["eps"]
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2 = math.sqrt(1 - beta2**step) if group["bias_correction"] else 1.0
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        g = p.grad.float()
        n = torch.linalg.vector_norm(g) if group["norm_type"] == 2 else g.abs().amax()
        st = self.state[p]
        if not st:
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros((), device=p.device) if group["init_zero"] \
                else n.clone()
        v = st["exp_avg_sq"]
        if group["norm_type"] == 2:
            v = torch.sqrt(beta2 * v * v + (1 - beta2) * n * n)
        else:
            v = beta2 * v + (1 - beta2) * n
        st["exp_avg_sq"] = v
        denom = v / bc2 + eps
        p32, m = p.float(), st["exp_avg"].float()
        if self.moment_mode == 0:
            m = beta1 * m + beta3 * (g / denom + wd * p32)
            new_p = p32 - lr * (m / bc1)
        else:
            m = beta1 * m + beta3 * g
            new_p = p32 - lr * ((m / bc1) / denom + wd * p32)
        p.copy_(new_p)
        st["exp_avg"].copy_(m)
