"""SGD with torch.optim.SGD's formulas, and the momentum step it shares with :func:`trace`."""

from __future__ import annotations

from typing import Any

import torch

from fmp.optim._base import GradientTransformation, _Update
from fmp.optim._bf16 import with_bf16_update
from fmp.optim._inplace import _SgdInPlace
from fmp.optim._leafwise import _add_scaled_, _increment, _leafwise, _Leaves, _zeros_tree
from fmp.optim._schedules import Schedule, _check_lr, _lr_at, _schedule_check
from fmp.optim._states import SgdState
from fmp.optim._validate import _check_momentum, _check_range


def _momentum(
    g: list[torch.Tensor],
    buf: list[torch.Tensor],
    count: torch.Tensor,
    m: float,
    d: float,
    nesterov: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """torch's momentum step on compute-dtype lists; returns (direction, new buffer).

    The buffer starts at zero, so ``m * 0 + 1 * g`` reproduces torch's first-step
    ``buf = grad`` exactly; with dampening the coefficient of ``g`` is 1 on the first
    update and ``1 - d`` after, picked with ``torch.where`` on the count.
    """
    new = torch._foreach_mul(buf, m)
    if d == 0.0:
        torch._foreach_add_(new, g)
    else:
        one = torch.ones((), dtype=torch.float32, device=count.device)
        _add_scaled_(new, g, torch.where(count == 0, one, one * (1.0 - d)))
    if nesterov:
        return torch._foreach_add(g, new, alpha=m), new
    return new, new


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    state_dtype: str | torch.dtype | None = torch.float32,
    bf16_update: str | None = None,
) -> GradientTransformation:
    """Stochastic gradient descent with the formulas of ``torch.optim.SGD``.

    Per step, with ``g`` the grad (in the compute dtype)::

        g = g + weight_decay * p                      # if weight_decay
        buf = g (first step), else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf   # if momentum
        update = -lr * g

    ``maximize`` is not offered (negate the grads, or use ``scale(-1)``).

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        momentum: momentum factor, a float >= 0 (0 disables the buffers).
        dampening: dampening for momentum (any float, as in torch).
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
        weight_decay: coupled L2 penalty, a float >= 0; ``update`` then needs params.
        state_dtype: dtype of the momentum buffers (default float32, also for bf16 /
            fp16 params; None keeps each param's dtype, like torch).
        bf16_update: for params stored in bfloat16 with no float32 copy: ``"kahan"``
            (:func:`kahan_summation`) or ``"stochastic"`` (:func:`stochastic_rounding`)
            writes; the result is ``chain(optimizer, ...)`` (state: a pair). None: none.

    Returns:
        A :class:`GradientTransformation` with state :class:`SgdState`.

    Raises:
        ValueError: a bad hyper-parameter (the message names the value and what is
            accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.sgd(0.1, momentum=0.9)
        >>> p = {"w": torch.ones(2)}
        >>> u, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> fmp.optim.apply_updates(p, u)
        {'w': tensor([0.9000, 0.9000])}
    """
    lr = _check_lr("sgd", lr)
    m, d, sd = _check_momentum("sgd", momentum, dampening, nesterov, state_dtype)
    wd = _check_range("sgd", "weight_decay", weight_decay, accepted="a finite float >= 0")

    def init(params: Any) -> SgdState:
        count, zeros = _zeros_tree("sgd", params, sd)
        return SgdState(count, zeros() if m != 0.0 else None)

    def body(x: _Leaves, state: SgdState) -> tuple[list[torch.Tensor], SgdState]:
        g = x.g
        if x.p is not None:
            g = torch._foreach_add(g, x.p, alpha=wd)
        new_buf = None
        if m != 0.0:
            if state.momentum is None:
                raise TypeError("sgd.update: this sgd has momentum but the state holds no "
                                "momentum buffers (made by an sgd with momentum=0); rebuild "
                                "it with optimizer.init(params)")
            buf, stored = x.moments(state.momentum, "state.momentum")
            g, nb = _momentum(g, buf, state.count, m, d, nesterov)
            new_buf = x.store(nb, stored)
        updates = torch._foreach_mul(g, -_lr_at(lr, state.count))
        return updates, SgdState(_increment(state.count), new_buf)

    update = _leafwise("sgd", body, state_type=SgdState, state_dtype=sd,
                       reads_params=wd != 0.0)
    return with_bf16_update("sgd", GradientTransformation(init, _Update(
        update, schedule_check=_schedule_check(lr),
        in_place=_SgdInPlace(lr, m, d, nesterov, wd))), bf16_update)
