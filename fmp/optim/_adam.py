"""Adam and AdamW with torch.optim's formulas, and Adam's rescaling alone (scale_by_adam)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fmp.optim._base import GradientTransformation, _Update
from fmp.optim._bf16 import with_bf16_update
from fmp.optim._inplace import _AdamInPlace
from fmp.optim._leafwise import _add_scaled_, _increment, _leafwise, _Leaves, _zeros_tree
from fmp.optim._schedules import Schedule, _check_lr, _lr_at, _schedule_check
from fmp.optim._states import AdamState
from fmp.optim._validate import _check_amsgrad, _check_betas, _check_range, _state_dtype


def _step_dtype(dts: list[torch.dtype]) -> torch.dtype:
    """float64 for the step scalars (bias corrections) where a leaf computes in float64."""
    return torch.float64 if torch.float64 in dts else torch.float32


def _bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor | None:
    """``1 - beta**step`` as a float32 0-d tensor, or None for ``beta == 0`` (it is 1).

    Written as ``-expm1(step * log(beta))``: accurate in float32 where ``1 - beta**step``
    would lose digits to cancellation (beta2 = 0.999 at step 1).
    """
    if beta == 0.0:
        return None
    return -torch.expm1(step * math.log(beta))


def _adam_init(fn: str, sd: torch.dtype | None, amsgrad: bool) -> Callable[[Any], AdamState]:
    """The ``init`` of Adam-family transformations: zero moments in the state dtype."""

    def init(params: Any) -> AdamState:
        count, zeros = _zeros_tree(fn, params, sd)
        return AdamState(count=count, mu=zeros(), nu=zeros(),
                         nu_max=zeros() if amsgrad else None)

    return init


def _adam_scaled(
    x: _Leaves, g: list[torch.Tensor], state: AdamState, b1: float, b2: float, eps: float,
    amsgrad: bool,
) -> tuple[list[torch.Tensor], torch.Tensor | None, AdamState]:
    """One Adam step before the learning rate, torch's formulas (lerp, mul + addcmul).

    Returns ``mu / (sqrt(v) / sqrt(1 - b2**t) + eps)`` (fresh tensors, torch's eps
    placement), the first bias correction ``1 - b1**t`` (None for b1 == 0) and the new
    state (its moments cast back to their stored dtypes).
    """
    count = _increment(state.count)
    step = count.to(_step_dtype(x.dts))
    mu, mu_dts = x.moments(state.mu, "state.mu")
    nu, nu_dts = x.moments(state.nu, "state.nu")
    mu = torch._foreach_lerp(mu, g, 1.0 - b1)
    nu = torch._foreach_mul(nu, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
    nu_max, max_dts = None, []
    if amsgrad:
        if state.nu_max is None:
            raise TypeError("the optimizer has amsgrad=True but its state has no nu_max (made "
                            "by an optimizer with amsgrad=False); rebuild it with "
                            "optimizer.init(params)")
        old, max_dts = x.moments(state.nu_max, "state.nu_max")
        nu_max = torch._foreach_maximum(old, nu)
    denom = torch._foreach_sqrt(nu if nu_max is None else nu_max)
    bc2 = _bias_correction(b2, step)
    if bc2 is not None:
        torch._foreach_div_(denom, bc2.sqrt())
    torch._foreach_add_(denom, eps)
    direction = torch._foreach_div(mu, denom)
    new_state = AdamState(count=count, mu=x.store(mu, mu_dts), nu=x.store(nu, nu_dts),
                          nu_max=None if nu_max is None else x.store(nu_max, max_dts))
    return direction, _bias_correction(b1, step), new_state


def _adam_like(
    fn: str,
    lr: float | Schedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    state_dtype: str | torch.dtype | None,
    decoupled: bool,
) -> GradientTransformation:
    lr = _check_lr(fn, lr)
    b1, b2 = _check_betas(fn, betas)
    eps = _check_range(fn, "epsilon value eps", eps, accepted="a finite float >= 0")
    wd = _check_range(fn, "weight_decay", weight_decay, accepted="a finite float >= 0")
    amsgrad = _check_amsgrad(fn, amsgrad)
    sd = _state_dtype(fn, state_dtype)

    def body(x: _Leaves, state: AdamState) -> tuple[list[torch.Tensor], AdamState]:
        g, p = x.g, x.p
        if p is not None and not decoupled:
            g = torch._foreach_add(g, p, alpha=wd)
        lr_now = _lr_at(lr, state.count)
        updates, bc1, new_state = _adam_scaled(x, g, state, b1, b2, eps, amsgrad)
        step_size = lr_now if bc1 is None else lr_now / bc1
        torch._foreach_mul_(updates, -step_size)
        if p is not None and decoupled:
            _add_scaled_(updates, p, -(lr_now * wd))
        return updates, new_state

    update = _leafwise(fn, body, state_type=AdamState, state_dtype=sd, reads_params=wd != 0.0)
    return GradientTransformation(_adam_init(fn, sd, amsgrad), _Update(
        update, schedule_check=_schedule_check(lr),
        in_place=_AdamInPlace(lr, b1, b2, eps, wd, amsgrad, decoupled)))


def adam(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
    bf16_update: str | None = None,
) -> GradientTransformation:
    """Adam with the formulas of ``torch.optim.Adam`` (coupled L2 weight decay).

    Per step ``t = count + 1``, with ``g`` the grad in the compute dtype::

        g = g + weight_decay * p                      # if weight_decay
        mu = lerp(mu, g, 1 - beta1);  nu = beta2 * nu + (1 - beta2) * g * g
        v = max(nu_max, nu) if amsgrad else nu
        denom = sqrt(v) / sqrt(1 - beta2**t) + eps
        update = -(lr / (1 - beta1**t)) * mu / denom

    ``maximize``, ``capturable``, ``fused`` and complex params are not offered (the
    update is always capturable: no host sync).

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, a float >= 0.
        weight_decay: coupled L2 penalty added to the grad, a float >= 0; ``update``
            then needs params.
        amsgrad: keep the running maximum of ``nu`` and divide by it (AMSGrad).
        state_dtype: dtype of the moments (default float32, also for bf16 / fp16 params;
            None keeps each param's dtype, like torch).
        bf16_update: for params stored in bfloat16 with no float32 copy: ``"kahan"``
            (:func:`kahan_summation`) or ``"stochastic"`` (:func:`stochastic_rounding`)
            writes; the result is ``chain(optimizer, ...)`` (state: a pair). None: none.

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter or ``bf16_update`` (the message names the value
            and what is accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.adam(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> u, s = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(p), p)
        >>> u
        {'w': tensor([-0.1000,  0.1000])}
    """
    return with_bf16_update("adam", _adam_like("adam", lr, betas, eps, weight_decay, amsgrad,
                                               state_dtype, False), bf16_update)


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
    bf16_update: str | None = None,
) -> GradientTransformation:
    """AdamW with the formulas of ``torch.optim.AdamW`` (decoupled weight decay).

    As :func:`adam` without the L2 term on the grad; instead the update also holds
    ``-lr * weight_decay * p`` (torch's ``p *= 1 - lr * weight_decay``), with ``lr`` the
    current (scheduled) rate.

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, a float >= 0.
        weight_decay: decoupled decay, a float >= 0 (default 1e-2 as in torch);
            ``update`` then needs params.
        amsgrad: keep the running maximum of ``nu`` and divide by it (AMSGrad).
        state_dtype: dtype of the moments (default float32, also for bf16 / fp16 params;
            None keeps each param's dtype, like torch).
        bf16_update: for params stored in bfloat16 with no float32 copy: ``"kahan"``
            (:func:`kahan_summation`) or ``"stochastic"`` (:func:`stochastic_rounding`)
            writes; the result is ``chain(optimizer, ...)`` (state: a pair). None: none.

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter or ``bf16_update`` (the message names the value
            and what is accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.adamw(0.1, weight_decay=0.5)
        >>> p = {"w": torch.ones(1)}
        >>> opt.update({"w": torch.ones(1)}, opt.init(p), p)[0]
        {'w': tensor([-0.1500])}
    """
    return with_bf16_update("adamw", _adam_like("adamw", lr, betas, eps, weight_decay, amsgrad,
                                                state_dtype, True), bf16_update)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Adam's rescaling without the learning rate: ``mu_hat / (sqrt(nu_hat) + eps)``.

    With torch's eps placement: ``(mu / (1 - b1**t)) / (sqrt(nu) / sqrt(1 - b2**t) + eps)``.
    ``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))`` is
    AdamW up to rounding; :func:`adam` / :func:`adamw` are the fused forms.

    Args:
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1).
        eps: added to the denominator, a float >= 0.
        amsgrad: divide by the running maximum of ``nu``.
        state_dtype: dtype of the moments (default float32; None keeps each param's).

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter; (in ``init``) a leaf is not a floating
            tensor; (in ``update``) a tree differs in structure from the state.

    Example:
        >>> t = fmp.optim.scale_by_adam()
        >>> t.update({"w": torch.tensor([2.0])}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([1.0000])}
    """
    fn = "scale_by_adam"
    b1, b2 = _check_betas(fn, (b1, b2))
    eps = _check_range(fn, "epsilon value eps", eps, accepted="a finite float >= 0")
    amsgrad = _check_amsgrad(fn, amsgrad)
    sd = _state_dtype(fn, state_dtype)

    def body(x: _Leaves, state: AdamState) -> tuple[list[torch.Tensor], AdamState]:
        updates, bc1, new_state = _adam_scaled(x, x.g, state, b1, b2, eps, amsgrad)
        if bc1 is not None:
            torch._foreach_div_(updates, bc1)
        return updates, new_state

    update = _leafwise(fn, body, state_type=AdamState, state_dtype=sd)
    return GradientTransformation(_adam_init(fn, sd, amsgrad), update)
