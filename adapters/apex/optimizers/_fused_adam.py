"""``apex.optimizers.FusedAdam`` on ``torch.optim.Adam`` (fused on CUDA, foreach on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adapters.apex import amp_C
from adapters.apex._warn import warn_unsupported
from adapters.apex.optimizers._common import kernel_kwargs, materialize, per_param_steps
from adapters.apex.optimizers._subset import step_groups, step_own_groups


class FusedAdam(torch.optim.Adam):
    """Apex's FusedAdam: AdamW by default (``adam_w_mode=True``), Adam with L2 otherwise.

    It is ``torch.optim.Adam(decoupled_weight_decay=adam_w_mode)`` with ``fused=True``
    when every param is on CUDA and ``foreach=True`` otherwise, so it equals
    ``torch.optim.AdamW`` (or ``Adam``) step by step. Apex's other arguments:

    - ``bias_correction=False``: those groups are updated by
      :func:`adapters.apex.amp_C.multi_tensor_adam` without bias correction.
    - ``set_grad_none``: what ``zero_grad()`` does when not told (True: grads to None).
    - ``capturable``: passed to torch (a CUDA-graph-safe step).
    - ``master_weights=True`` (also spelt ``use_master``): warns; the params are updated
      in their own dtype (use amp ``opt_level="O2"`` for float32 master weights).

    Unlike Apex, the moments of float16 params are kept in float16 (torch's choice).

    Args:
        params: params or param groups.
        lr: learning rate (1e-3).
        bias_correction: Adam's bias correction (True).
        betas: moment coefficients ((0.9, 0.999)).
        eps: added to the denominator (1e-8).
        adam_w_mode: decoupled weight decay (True) or L2 (False).
        weight_decay: weight decay (0).
        amsgrad: must be False, as in Apex.
        set_grad_none: ``zero_grad()`` sets grads to None (True).
        capturable: torch's ``capturable`` (False).
        master_weights: unsupported, warns.

    Raises:
        RuntimeError: ``amsgrad=True``, or ``step`` given Apex's removed arguments.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = FusedAdam([w], lr=0.1, weight_decay=0.01)
        >>> w.grad = torch.ones(2); opt.step()
        >>> [round(x, 4) for x in w.tolist()]
        [0.899, 0.899]
    """

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False, use_master: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant "
                               "(amsgrad=True); use torch.optim.Adam(amsgrad=True)")
        if master_weights or use_master:
            warn_unsupported("FusedAdam", "master_weights", True,
                             "the params are updated in their own dtype; use amp "
                             "opt_level='O2' for float32 master weights")
        params = materialize(params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode), capturable=capturable,
                         **kernel_kwargs(params))
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)
        self.defaults["bias_correction"] = bias_correction
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the grads; ``set_to_none`` defaults to the ``set_grad_none`` given."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None,
             output_params: Any = None, scale: Any = None, grad_norms: Any = None,
             grad_scaler: Any = None) -> Any:
        """One step. ``closure`` as in torch; Apex's removed arguments raise.

        Raises:
            RuntimeError: ``grads``, ``output_params``, ``scale`` or ``grad_norms`` given.
        """
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam.step takes only a closure: grads, output_params, "
                               "scale and grad_norms were removed from Apex's FusedAdam")
        if grad_scaler is not None:
            warn_unsupported("FusedAdam.step", "grad_scaler", grad_scaler,
                             "ignored; torch.amp.GradScaler.step(optimizer) unscales and "
                             "skips for the fused kernel itself")
        plain = [g for g in self.param_groups if not g.get("bias_correction", True)]
        if not plain:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_groups(self, [g for g in self.param_groups if g.get("bias_correction", True)],
                    super().step)
        step_own_groups(self, plain, self._step_without_bias_correction)
        return loss

    @torch.no_grad()
    def _step_without_bias_correction(self, group: dict[str, Any]) -> None:
        lists: list[list[torch.Tensor]] = [[], [], [], []]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            for lst, t in zip(lists, (p.grad, p, st["exp_avg"], st["exp_avg_sq"]),
                              strict=True):
                lst.append(t)
        if not lists[0]:
            return
        beta1, beta2 = group["betas"]
        step = int(self.state[lists[1][0]]["step"])
        flag = torch.zeros(1, dtype=torch.int, device=lists[1][0].device)
        amp_C.multi_tensor_adam(0, flag, lists, float(group["lr"]), beta1, beta2, group["eps"],
                                step, self.adam_w_mode, 0, group["weight_decay"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch or an Apex FusedAdam checkpoint (Apex kept one step per group)."""
        super().load_state_dict(per_param_steps(state_dict))
