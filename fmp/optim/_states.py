"""The state records of fmp's transformations (their layouts are known only inside fmp.optim)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class EmptyState(NamedTuple):
    """The state of a stateless transformation (no leaves).

    Example:
        >>> fmp.optim.scale(0.5).init({"w": torch.ones(2)})
        EmptyState()
    """


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates at the
            int32 maximum).
        momentum: the momentum buffers, a tree like the params in ``state_dtype``, or
            None when ``momentum == 0``.

    Example:
        >>> fmp.optim.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        SgdState(count=tensor(0, dtype=torch.int32), momentum={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    momentum: Any


class AdamState(NamedTuple):
    """State of :func:`adam`, :func:`adamw` and :func:`scale_by_adam`.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).
        mu: first moments (torch's ``exp_avg``), a tree like the params in
            ``state_dtype``.
        nu: second moments (torch's ``exp_avg_sq``), same structure and dtype.
        nu_max: running maximum of ``nu`` (torch's ``max_exp_avg_sq``) when
            ``amsgrad=True``, else None.

    Example:
        >>> fmp.optim.adam().init({"w": torch.ones(2)}).count
        tensor(0, dtype=torch.int32)
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any = None


class TraceState(NamedTuple):
    """State of :func:`trace` (torch-style momentum).

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).
        trace: the momentum buffers, a tree like the params in ``state_dtype``.

    Example:
        >>> fmp.optim.trace(0.9).init({"w": torch.ones(1)}).trace
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    trace: Any


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).

    Example:
        >>> fmp.optim.scale_by_learning_rate(lambda c: 0.1 * 0.5**c).init({})
        ScaleByScheduleState(count=tensor(0, dtype=torch.int32))
    """

    count: torch.Tensor


# Pickles (torch.save of a TrainState, torch.load's weights_only allowlist) name a class by
# its module: the public one, so that checkpoints do not depend on this file's name.
for _cls in (EmptyState, SgdState, AdamState, TraceState, ScaleByScheduleState):
    _cls.__module__ = "fmp.optim"
del _cls
