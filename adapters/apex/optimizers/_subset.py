"""Run a torch optimizer's own step over some of its param groups only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
