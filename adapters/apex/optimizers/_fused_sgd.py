"""``apex.optimizers.FusedSGD`` on ``torch.optim.SGD`` (fused on CUDA, foreach on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adapters.apex import amp_C
from adapters.apex._warn import warn_unsupported
from adapters.apex.optimizers._common import kernel_kwargs, materialize
from adapters.apex.optimizers._subset import step_groups, step_own_groups


class _Required:
    def __repr__(self) -> str:
        return "<required parameter>"


required = _Required()


def _torch_required() -> Any:
    """torch's "required" marker, which ``add_param_group`` checks (ours where absent)."""
    try:
        from torch.optim.optimizer import required as torch_required
    except ImportError:  # pragma: no cover - older/newer torch without it
        return required
    return torch_required


class FusedSGD(torch.optim.SGD):
    """Apex's FusedSGD: ``torch.optim.SGD`` with Apex's arguments and defaults.

    Momentum starts from the first grad and weight decay is added before momentum,
    as in both Apex and torch. Apex's extras:

    - ``wd_after_momentum=True``: weight decay added after momentum; those groups are
      updated by :func:`adapters.apex.amp_C.multi_tensor_sgd` (torch has no such SGD).
    - ``set_grad_none``: what ``zero_grad()`` does when not told (False: zero them).
    - ``materialize_master_grads=False``: warns; master grads are always materialized.

    Args:
        params: params or param groups.
        lr: learning rate (required).
        momentum: momentum factor (0).
        dampening: momentum dampening (0).
        weight_decay: L2 penalty (0).
        nesterov: Nesterov momentum (False).
        wd_after_momentum: apply weight decay after momentum (False).
        materialize_master_grads: unsupported when False, warns.
        set_grad_none: ``zero_grad()`` sets grads to None (False).

    Raises:
        ValueError: no ``lr``, or nesterov without momentum or with dampening.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = FusedSGD([w], lr=0.5, momentum=0.9)
        >>> w.grad = torch.ones(1); opt.step(); w.item()
        0.5
    """

    def __init__(self, params: Any, lr: Any = required, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: bool = False) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"FusedSGD: nesterov=True requires momentum > 0 and dampening "
                             f"== 0, got momentum={momentum!r}, dampening={dampening!r}")
        if not materialize_master_grads:
            warn_unsupported("FusedSGD", "materialize_master_grads", False,
                             "float32 master grads are always materialized (amp O2)")
        params = materialize(params)
        default_lr = lr
        if lr is required:  # as in Apex: fine when every param group gives its own lr
            groups = params if params and isinstance(params[0], dict) else None
            if groups is None or any("lr" not in g for g in groups):
                raise ValueError("FusedSGD: lr is required (Apex has no default learning "
                                 "rate): pass lr=..., or give every param group its 'lr'")
            default_lr = groups[0]["lr"]
        super().__init__(params, lr=default_lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov,
                         **kernel_kwargs(params))
        for group in self.param_groups:
            group.setdefault("wd_after_momentum", wd_after_momentum)
        self.defaults["wd_after_momentum"] = wd_after_momentum
        if lr is required:  # a group added later without its lr raises, as in Apex
            self.defaults["lr"] = _torch_required()
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the grads; ``set_to_none`` defaults to the ``set_grad_none`` given."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step; ``closure`` as in torch."""
        after = [g for g in self.param_groups if g.get("wd_after_momentum", False)]
        if not after:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step_groups(self, [g for g in self.param_groups
                           if not g.get("wd_after_momentum", False)], super().step)
        step_own_groups(self, after, self._step_wd_after_momentum)
        return loss

    @torch.no_grad()
    def _step_wd_after_momentum(self, group: dict[str, Any]) -> None:
        fresh: list[list[torch.Tensor]] = [[], [], []]  # first step: momentum = grad
        seen: list[list[torch.Tensor]] = [[], [], []]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            first = st.get("momentum_buffer") is None
            if first:
                st["momentum_buffer"] = torch.zeros_like(p)
            for lst, t in zip(fresh if first else seen, (p.grad, p, st["momentum_buffer"]),
                              strict=True):
                lst.append(t)
        for first, lists in ((True, fresh), (False, seen)):
            if lists[0]:
                flag = torch.zeros(1, dtype=torch.int, device=lists[1][0].device)
                amp_C.multi_tensor_sgd(0, flag, lists, group["weight_decay"],
                                       group["momentum"], group["dampening"],
                                       float(group["lr"]), group["nesterov"], first, True,
                                       1.0)
