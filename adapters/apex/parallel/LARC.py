"""``apex.parallel.LARC``: layer-wise adaptive rate clipping/scaling around any optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LARC"]


class LARC:
    """Wrap ``optimizer`` so each param's step uses LARS's trust ratio (arXiv:1708.03888).

    For each param with a grad, where ``||p||`` and ``||g||`` are both non-zero::

        local_lr = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
        clip=True:  factor = min(local_lr / lr, 1)   # the step uses min(lr, local_lr)
        clip=False: factor = local_lr                # the step uses lr * local_lr
        g <- (g + weight_decay * p) * factor

    The group's ``weight_decay`` is folded in there and is set to 0 for the inner step
    (restored after); a param with a zero norm or zero grad gets neither factor nor decay,
    as in Apex. The norms stay on the device (no host sync).

    Args:
        optimizer: any torch optimizer.
        trust_coefficient: the trust coefficient (0.02).
        clip: clipping (True) or scaling (False) mode.
        eps: added to the denominator (1e-8).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
        >>> opt = LARC(torch.optim.SGD([w], lr=1.0), trust_coefficient=0.1)
        >>> w.grad = torch.tensor([0.0, 10.0]); opt.step()  # local lr 0.1*5/10 = 0.05
        >>> w.tolist()
        [3.0, 3.5]
    """

    def __init__(self, optimizer: Any, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self) -> Any:
        return self.optim.__getstate__()

    def __setstate__(self, state: Any) -> None:
        self.optim.__setstate__(state)

    @property
    def state(self) -> Any:
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    @property
    def param_groups(self) -> Any:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optim.param_groups = value

    @property
    def defaults(self) -> Any:
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale the grads by the trust ratio, then step the wrapped optimizer."""
        decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                wd = group.get("weight_decay", 0)
                decays.append(wd)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    pn = torch.linalg.vector_norm(p)
                    gn = torch.linalg.vector_norm(p.grad)
                    local = self.trust_coefficient * pn / (gn + pn * wd + self.eps)
                    if self.clip:
                        local = torch.clamp(local / group["lr"], max=1.0)
                    ok = (pn != 0) & (gn != 0)
                    new = (p.grad + wd * p) * local
                    p.grad.copy_(torch.where(ok, new, p.grad))
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, decays, strict=True):
                group["weight_decay"] = wd
