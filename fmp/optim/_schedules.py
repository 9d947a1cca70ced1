"""Learning rates: a constant or a schedule, the rate of one update, and :func:`schedule_ok`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fmp.optim._base import GradientTransformation, _capability
from fmp.optim._validate import _check_range

#: A learning-rate schedule: called with the step count (a 0-d int32 tensor: the number of
#: updates applied before this one) it returns the rate as a 0-d tensor or a Python float.
#: It must not synchronise the host (no ``.item()``) if the update is to be compiled. A
#: rate that comes out inf, NaN or negative is never applied: the update uses 0 and
#: :func:`fmp.train_step` skips the step (:func:`schedule_ok`).
Schedule = Callable[[torch.Tensor], "torch.Tensor | float"]


def _check_lr(fn: str, lr: object) -> float | Schedule:
    if callable(lr):
        return lr  # type: ignore[return-value]
    return _check_range(
        fn, "learning rate lr", lr,
        accepted="a finite float >= 0 or a schedule callable(count) -> 0-d tensor or float",
    )


def _lr_value(lr: Schedule, count: torch.Tensor) -> float | torch.Tensor:
    value = lr(count)
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32)
    return float(value)


def _lr_valid(value: float | torch.Tensor) -> torch.Tensor | bool:
    """Whether a scheduled rate is finite and >= 0 (a bool tensor for a tensor rate)."""
    if isinstance(value, torch.Tensor):
        return value.isfinite() & (value >= 0)
    return math.isfinite(value) and value >= 0.0


def _lr_at(lr: float | Schedule, count: torch.Tensor) -> float | torch.Tensor:
    """The learning rate for the update after ``count`` applied ones.

    A scheduled rate that is not finite or is negative is replaced by 0 (branch-free, no
    host sync), so it can never put inf / NaN into the params; :func:`train_step` also
    skips such a step (see :func:`schedule_ok`).
    """
    if not callable(lr):
        return lr
    value = _lr_value(lr, count)
    ok = _lr_valid(value)
    if isinstance(value, torch.Tensor):
        return torch.where(ok, value, torch.zeros_like(value))
    return value if ok else 0.0


def _schedule_check(lr: float | Schedule) -> Callable[[Any], torch.Tensor] | None:
    """``state -> whether the rate read at state.count is valid``, or None for a constant."""
    if not callable(lr):
        return None

    def check(state: Any) -> torch.Tensor:
        ok = _lr_valid(_lr_value(lr, state.count))
        if isinstance(ok, torch.Tensor):
            return ok.reshape(())
        return torch.full((), ok, dtype=torch.bool, device=state.count.device)

    return check


def schedule_ok(optimizer: GradientTransformation, opt_state: Any) -> torch.Tensor | None:
    """Whether the learning rates the next update reads from its schedules are usable.

    A schedule (a callable ``lr``) may return inf, NaN or a negative rate; the optimizer
    then uses 0 instead, and :func:`fmp.train_step` skips the step (params, optimizer state
    and model state unchanged, ``metrics["skipped"]`` True while ``grads_finite`` is True,
    ``metrics["lr_ok"]`` False). Nothing syncs the host.

    Args:
        optimizer: a :class:`GradientTransformation`.
        opt_state: its state (``optimizer.init(params)`` or a later one).

    Returns:
        A 0-d bool tensor (True when every scheduled rate is finite and >= 0), or None
        when the optimizer has no schedule (or is a ``GradientTransformation`` built from
        a plain ``update`` function, whose schedules fmp cannot see).

    Example:
        >>> opt = fmp.optim.sgd(lambda count: 0.1 - 0.05 * count)
        >>> s = opt.init({"w": torch.ones(1)})
        >>> bool(fmp.optim.schedule_ok(opt, s)), fmp.optim.schedule_ok(fmp.optim.sgd(0.1), s)
        (True, None)
    """
    update = _capability(optimizer)
    check = None if update is None else update.schedule_check
    return None if check is None else check(opt_state)
