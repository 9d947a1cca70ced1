"""Run a torch optimizer's own step over some of its param groups only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def step_groups(optimizer: Any, groups: list[dict[str, Any]], step: Callable[[], Any]) -> None:
    """Call ``step()`` with ``optimizer.param_groups`` narrowed to ``groups``, then restore.

    The Fused* optimizers hand the groups torch's kernels cover to torch's ``step`` and
    update the others (an Apex option torch lacks) themselves.

    Args:
        optimizer: the optimizer whose ``param_groups`` are narrowed.
        groups: the groups torch's step updates (nothing is called when empty).
        step: the torch step, e.g. ``super().step``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1)); w.grad = torch.ones(1)
        >>> opt = torch.optim.SGD([{"params": [w]}], lr=0.5)
        >>> step_groups(opt, [], opt.step); w.item()
        1.0
        >>> step_groups(opt, opt.param_groups, opt.step); w.item()
        0.5
    """
    every = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        if groups:
            step()
    finally:
        optimizer.param_groups = every


def step_own_groups(optimizer: Any, groups: list[dict[str, Any]],
                    step_group: Callable[[dict[str, Any]], None]) -> None:
    """Update ``groups`` with the optimizer's own code, honouring torch's amp protocol.

    torch's fused optimizers read two attributes that ``torch.amp.GradScaler`` and amp
    set on the optimizer before ``step``: ``grad_scale`` (the grads are still multiplied by
    it) and ``found_inf`` (1.0: skip). torch's kernel applies both on the device for the
    groups it covers; the groups a Fused* optimizer updates itself (options torch lacks)
    get the same here: a ``found_inf`` of 1 leaves them, their state and step counts as
    they were (one host read of the flag, only where such groups exist), and grads are
    divided by ``grad_scale`` for the update only (the ``.grad`` tensors are restored).

    Args:
        optimizer: the optimizer (its ``grad_scale`` / ``found_inf``, if set, are read).
        groups: the groups to update (nothing happens when empty).
        step_group: updates one group in place from its params' ``.grad``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1)); w.grad = torch.ones(1)
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> def sgd(group):
        ...     for p in group["params"]:
        ...         p.data.add_(p.grad, alpha=-group["lr"])
        >>> opt.found_inf = torch.ones(())
        >>> step_own_groups(opt, opt.param_groups, sgd); w.item()
        1.0
        >>> opt.found_inf = torch.zeros(()); opt.grad_scale = torch.tensor(4.0)
        >>> w.grad = torch.full((1,), 4.0)
        >>> step_own_groups(opt, opt.param_groups, sgd); w.item(), w.grad.item()
        (0.5, 4.0)
    """
    if not groups:
        return
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and bool(found_inf.item() != 0):
        return
    grad_scale = getattr(optimizer, "grad_scale", None)
    saved: list[tuple[Any, Any]] = []
    try:
        if grad_scale is not None:
            for group in groups:
                for p in group["params"]:
                    if p.grad is not None:
                        saved.append((p, p.grad))
                        scale = grad_scale.to(device=p.grad.device, dtype=torch.float32)
                        p.grad = (p.grad.float() / scale).to(p.grad.dtype)
        for group in groups:
            step_group(group)
    finally:
        for p, g in saved:
            p.grad = g
