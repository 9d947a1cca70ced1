"""``fmp.value_and_grad`` and the scaled loss a train step differentiates: the compute casts
of params and batch, the forward under the policy (and autocast), the loss scaled in float32."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fmp import _model
from fmp._batch_cast import CastBatch, cast_batch_args, check_cast_batch, warn_cast_overflow
from fmp._checks import check_loss_scale, check_param_policies
from fmp._grad import grad_with_aux
from fmp.float8 import _context as _float8
from fmp.policy import Policy, cast_params, get_policy
from fmp.tree import floating_leaves


def _autocast_ctx(params: Any, compute_dtype: torch.dtype, enabled: bool):
    if not enabled or compute_dtype not in (torch.float16, torch.bfloat16):
        return contextlib.nullcontext()
    leaves = floating_leaves(params)
    device_type = leaves[0].device.type if leaves else "cpu"
    return torch.autocast(device_type=device_type, dtype=compute_dtype)


def _check_loss(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.dim() == 0):
        what = (f"a tensor of dtype {loss.dtype} and shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor) else type(loss).__name__)
        raise ValueError(f"loss_fn must return a 0-d floating tensor as its loss, got {what}")
    return loss


def value_and_grad(
    loss_fn: Callable[..., Any],
    policy: str | Policy = "fp32",
    has_aux: bool = False,
    autocast: bool = False,
    param_policies: Mapping[str, Policy] | None = None,
    cast_batch: CastBatch = True,
) -> Callable[..., tuple[Any, Any, torch.Tensor]]:
    """Loss, unscaled grads and a finite flag, computed under a mixed-precision policy.

    The returned ``fn(params, loss_scale, *args, **kwargs)``:

    1. casts ``params`` to the compute dtype (per parameter with ``param_policies``; norm
       layers of an :func:`fmp.functional` module stay float32 under mixed presets) and
       the floating leaves of ``args``/``kwargs`` to the policy's compute dtype;
    2. calls ``loss_fn(cast_params, *cast_args, **cast_kwargs)``, inside ``torch.autocast``
       when ``autocast=True`` (op-level cast lists, as Apex O1);
    3. scales the loss (in float32) and differentiates it (``torch.func.grad`` when compiled
       or inside a torch.func transform, ``torch.autograd.grad`` on detached aliases in
       eager mode: the same function, the fastest kernels); the casts are differentiable,
       so grads arrive in each param's own dtype;
    4. unscales the grads and checks them with :func:`fmp.all_finite`.

    Args:
        loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (a 0-d floating tensor), or
            ``-> (loss, aux)`` with ``has_aux=True``.
        policy: a :class:`fmp.Policy` or a spec for :func:`fmp.get_policy`.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        autocast: also run ``loss_fn`` under ``torch.autocast`` at the compute dtype.
        param_policies: per-parameter policies (from :func:`fmp.module_policies`) for the
            compute cast of a params dict; inputs still follow ``policy``.
        cast_batch: which arguments' floating leaves are cast to the compute dtype: True
            (all), False (none), or one bool per positional argument (keyword arguments
            are cast unless it is False). The first call warns when the cast turns a
            finite value into inf (e.g. a float16 target above 65504).

    Returns:
        ``fn(params, loss_scale, *args, **kwargs) -> (loss, grads, finite)``, or
        ``((loss, aux), grads, finite)`` with ``has_aux``; ``loss`` is the unscaled float32
        loss, ``grads`` are unscaled, ``finite`` is a 0-d bool tensor. Nothing syncs the host.

    Raises:
        ValueError: (when called) ``loss_fn`` returned something other than a 0-d floating
            tensor as its loss; the policy spec is bad (at once).
        TypeError: ``param_policies`` is not a dict of :class:`fmp.Policy` (at once);
            (when called) ``loss_scale`` is not a loss-scale record (None, a float).

    Example:
        >>> vg = fmp.value_and_grad(lambda p, x: (p["w"] * x).sum(), "bf16-mixed")
        >>> loss, grads, finite = vg({"w": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3))
        >>> grads["w"].dtype, bool(finite)
        (torch.float32, True)
    """
    check_param_policies(param_policies, "value_and_grad")
    pol = get_policy(policy)
    cast_batch = check_cast_batch(cast_batch)
    cast_p = Caster(pol, param_policies)
    scaled_loss = scaled_loss_fn(loss_fn, pol, has_aux, autocast, cast_p, cast_batch)
    first = [True]

    def fn(params: Any, loss_scale: Any, *args: Any, **kwargs: Any):
        check_loss_scale(loss_scale, "value_and_grad")
        if first[0] and not torch.compiler.is_compiling():
            first[0] = False
            warn_cast_overflow(args, kwargs, pol.compute_dtype, cast_batch,
                               "fmp.value_and_grad")
        cast_p.resolve(params)  # norm layers of an fmp.functional module: float32
        grads, (loss, aux) = grad_with_aux(
            lambda p: scaled_loss(p, loss_scale, (), args, kwargs, True), params)
        grads, finite = loss_scale.unscale_and_check(grads)
        return ((loss, aux) if has_aux else loss), grads, finite

    return fn


class Caster:
    """The cast of a params tree to its compute dtypes (per param with ``param_policies``).

    Without ``param_policies`` and under a mixed policy with float32 params, the params of
    norm layers stay in float32 when the params dict matches a module given to
    :func:`fmp.functional` (:func:`fmp._model.default_param_policies`, looked up in eager
    mode whenever the dict's names change). One object per step, the cast its compute
    copy's stamps vouch for.
    """

    def __init__(self, pol: Policy, param_policies: Mapping[str, Policy] | None) -> None:
        self.pol = pol
        self.given = param_policies
        self.policies = param_policies
        self._names: tuple[Any, ...] | None = None

    def resolve(self, params: Any) -> None:
        """Find the default per-param policies for ``params`` (eager, host side)."""
        if self.given is not None or torch.compiler.is_compiling():
            return
        names = tuple(params) if isinstance(params, Mapping) else None
        if names != self._names:
            self.policies = _model.default_param_policies(params, self.pol)
            self._names = names

    def __call__(self, p: Any) -> Any:
        if self.policies is not None:
            return cast_params(p, self.policies, "compute")
        return self.pol.cast_to_compute(p)


def scaled_loss_fn(loss_fn: Callable[..., Any], pol: Policy, has_aux: bool, autocast: bool,
                    cast_p: Caster, cast_batch: CastBatch = True,
                    skip_safe: bool = False) -> Callable[..., Any]:
    """``f(params, loss_scale, lead, args, kwargs, cast, float8=None) -> (scaled_loss,
    (loss32, aux))``.

    ``lead`` is passed to ``loss_fn`` before the batch and is not cast (model state);
    ``cast=False``: ``params`` are already in their compute dtypes (the step's copy);
    ``float8``: ``(records, probes)`` published to the float8 layers while ``loss_fn``
    runs (``fmp/float8/_context.py``), or None.
    """
    def scaled_loss(p: Any, loss_scale: Any, lead: tuple[Any, ...], args: tuple[Any, ...],
                    kwargs: dict[str, Any], cast: bool, float8: Any = None):
        cp = cast_p(p) if cast else p
        cargs, ckwargs = cast_batch_args(args, kwargs, pol.compute_dtype, cast_batch)
        act = _model.ACTIVE  # what apply_fn reads: how to cast the frozen params
        prev = (act.policy, act.param_policies, act.skip_safe)
        act.policy, act.param_policies, act.skip_safe = pol, cast_p.policies, skip_safe
        f8_prev = None if float8 is None else _float8.publish(*float8)
        try:
            with _autocast_ctx(p, pol.compute_dtype, autocast):
                out = loss_fn(cp, *lead, *cargs, **ckwargs)
        finally:
            act.policy, act.param_policies, act.skip_safe = prev
            if f8_prev is not None:
                _float8.restore(f8_prev)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("with has_aux=True, loss_fn must return (loss, aux), got "
                                 f"{type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, None
        loss32 = _check_loss(loss).float()
        return loss_scale.scale(loss32), (loss32, aux)

    return scaled_loss
