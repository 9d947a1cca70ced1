"""The building blocks for :func:`chain`: scale, scale_by_learning_rate, add_decayed_weights,
trace."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fmp.optim._base import GradientTransformation, _Update
from fmp.optim._leafwise import _count, _increment, _leafwise, _Leaves, _zeros_tree
from fmp.optim._schedules import Schedule, _check_lr, _lr_at, _schedule_check
from fmp.optim._sgd import _momentum
from fmp.optim._states import EmptyState, ScaleByScheduleState, TraceState
from fmp.optim._validate import _check_momentum, _check_range, _is_real


def _empty_init(params: Any) -> EmptyState:
    return EmptyState()


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant ``step_size``.

    Args:
        step_size: a real number (any sign).

    Returns:
        A stateless :class:`GradientTransformation` (state :class:`EmptyState`).
        Updates are in the compute dtype (float32 for bf16 / fp16 / fp32 grads).

    Raises:
        ValueError: ``step_size`` is not a real number.

    Example:
        >>> u, _ = fmp.optim.scale(-2.0).update({"w": torch.ones(1)}, fmp.optim.EmptyState())
        >>> u
        {'w': tensor([-2.])}
    """
    if not _is_real(step_size) or not math.isfinite(step_size):  # type: ignore[arg-type]
        raise ValueError(f"scale: invalid step_size {step_size!r}; accepted: a finite float")
    factor = float(step_size)

    def body(x: _Leaves, state: EmptyState) -> tuple[list[torch.Tensor], EmptyState]:
        return torch._foreach_mul(x.g, factor), state

    return GradientTransformation(_empty_init, _leafwise("scale", body))


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (by ``+learning_rate`` without flip_sign).

    Args:
        learning_rate: a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        flip_sign: negate, so that the result is a descent step (the default).

    Returns:
        A :class:`GradientTransformation`; its state is :class:`EmptyState` for a
        constant rate and :class:`ScaleByScheduleState` for a schedule.

    Raises:
        ValueError: ``learning_rate`` is negative, NaN or neither a float nor callable.

    Example:
        >>> t = fmp.optim.scale_by_learning_rate(0.1)
        >>> t.update({"w": torch.ones(1)}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    lr = _check_lr("scale_by_learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(params: Any) -> EmptyState | ScaleByScheduleState:
        if callable(lr):
            return ScaleByScheduleState(_count(optree.tree_leaves(params)))
        return EmptyState()

    def body(x: _Leaves, state: Any) -> tuple[list[torch.Tensor], Any]:
        if callable(lr):
            factor = _lr_at(lr, state.count) * sign
            state = ScaleByScheduleState(_increment(state.count))
        else:
            factor = lr * sign
        return torch._foreach_mul(x.g, factor), state

    update = _leafwise("scale_by_learning_rate", body,
                       state_type=ScaleByScheduleState if callable(lr) else EmptyState)
    return GradientTransformation(init, _Update(update, schedule_check=_schedule_check(lr)))


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (L2 / decoupled weight decay).

    Before a momentum or Adam scaling this is torch's coupled L2 decay
    (``grad + wd * param``); after :func:`scale_by_adam` and before
    :func:`scale_by_learning_rate` it is AdamW's decoupled decay.

    Args:
        weight_decay: a float >= 0.

    Returns:
        A stateless :class:`GradientTransformation`; its ``update`` needs ``params``.
        Updates are in the promoted dtype of update, param and float32.

    Raises:
        ValueError: ``weight_decay`` is negative or not a number; (in ``update``)
            ``params`` is None or differs in structure from the updates.

    Example:
        >>> t = fmp.optim.add_decayed_weights(0.5)
        >>> p = {"w": torch.ones(1)}
        >>> t.update({"w": torch.zeros(1)}, t.init(p), p)[0]
        {'w': tensor([0.5000])}
    """
    wd = _check_range("add_decayed_weights", "weight_decay", weight_decay,
                      accepted="a finite float >= 0")

    def body(x: _Leaves, state: EmptyState) -> tuple[list[torch.Tensor], EmptyState]:
        return torch._foreach_add(x.g, x.p, alpha=wd), state  # type: ignore[arg-type]

    return GradientTransformation(
        _empty_init, _leafwise("add_decayed_weights", body, promote_params=True))


def trace(
    decay: float,
    *,
    dampening: float = 0.0,
    nesterov: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Momentum as in ``torch.optim.SGD``: ``buf = decay * buf + (1 - dampening) * g``.

    On the first update the buffer is set to the incoming updates, with no dampening
    (torch's ``buf = grad.clone()``). The output is ``buf``, or ``g + decay * buf`` with
    ``nesterov=True``. Follow it with :func:`scale_by_learning_rate` for SGD.

    Args:
        decay: the momentum factor, a float >= 0.
        dampening: dampening of the incoming updates (torch's ``dampening``).
        nesterov: Nesterov momentum; needs ``decay > 0`` and ``dampening == 0``.
        state_dtype: dtype of the buffers (default float32; None keeps each param's).

    Returns:
        A :class:`GradientTransformation` with state :class:`TraceState`.

    Raises:
        ValueError: bad hyper-parameters (the message names the value and what is
            accepted); (in ``update``) a tree differs in structure from the state.

    Example:
        >>> t = fmp.optim.trace(0.9)
        >>> s = t.init({"w": torch.ones(1)})
        >>> u, s = t.update({"w": torch.ones(1)}, s)
        >>> t.update({"w": torch.ones(1)}, s)[0]
        {'w': tensor([1.9000])}
    """
    m, d, sd = _check_momentum("trace", decay, dampening, nesterov, state_dtype)

    def init(params: Any) -> TraceState:
        count, zeros = _zeros_tree("trace", params, sd)
        return TraceState(count, zeros())

    def body(x: _Leaves, state: TraceState) -> tuple[list[torch.Tensor], TraceState]:
        buf, stored = x.moments(state.trace, "state.trace")
        out, new_buf = _momentum(x.g, buf, state.count, m, d, nesterov)
        return out, TraceState(_increment(state.count), x.store(new_buf, stored))

    return GradientTransformation(
        init, _leafwise("trace", body, state_type=TraceState, state_dtype=sd))
