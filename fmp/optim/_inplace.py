"""The in-place fused form of sgd / adam / adamw, dispatched by :func:`update_in_place`.

``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` update params and moments in
one multi-tensor kernel, divide the grads by ``grad_scale`` on the way and do nothing when
``found_inf`` is 1: unscale, update and skip in a single pass, with no host sync. They are
the kernels behind ``torch.optim.Adam(fused=True)``. fmp uses them only where they compute
exactly its own formulas (otherwise :func:`update_in_place` returns None and the caller
takes the pure path):

- plain eager mode (not compiled, not inside a torch.func transform);
- every param, grad and moment on one device and of one dtype (float32, float16 or
  bfloat16), a CUDA or CPU device, each grad and moment laid out as its param;
- SGD without dampening (the fused kernel's first step differs with dampening).

The kernels here are the only code that reads the state layouts for an in-place update.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fmp._eager import eager_kernels_ok
from fmp.optim._base import GradientTransformation, _capability, _InPlace
from fmp.optim._schedules import Schedule, _lr_at
from fmp.optim._states import AdamState, SgdState

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: (params, grads, [moments...], the params' treespec)
_Lists = tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]], Any]


def _same_layouts(p: list[torch.Tensor], others: list[list[torch.Tensor]]) -> bool:
    """The fused kernels need each grad and moment shaped and laid out exactly as its param
    (a mismatch goes to the pure path, which names the leaf)."""
    return all(len(o) == 0 or all(a.shape == b.shape and a.stride() == b.stride()
                                  for a, b in zip(p, o, strict=True))
               for o in others)


def _uniform(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return False
    d, dev = tensors[0].dtype, tensors[0].device
    return d in _DTYPES and dev.type in ("cuda", "cpu") and all(
        t.dtype == d and t.device == dev for t in tensors)


def _lists(params: Any, grads: Any, moment_trees: Any) -> _Lists | None:
    """(params, grads, [moments...], treespec) as lists the fused kernels accept, or None.

    ``moment_trees(state_tree_flattener)`` returns the moment lists (an empty list for an
    absent buffer); any structure mismatch gives None.
    """
    p, tree = optree.tree_flatten(params)
    try:
        g = tree.flatten_up_to(grads)
        moments = moment_trees(tree.flatten_up_to)
    except (ValueError, TypeError, AttributeError):
        return None
    if not _uniform(p + g + [t for m in moments for t in m]):
        return None
    if not _same_layouts(p, [g, *moments]):
        return None
    return p, g, moments, tree


def _with_grads(prepared: _Lists, grads: Any) -> _Lists | None:
    """``prepared`` (checked by :func:`_lists`) with other grads of the same trees: only the
    grads are flattened and checked again (params and moments are as they were)."""
    p, _, moments, tree = prepared
    try:
        g = tree.flatten_up_to(grads)
    except (ValueError, TypeError, AttributeError):
        return None
    if not (_uniform([p[0], *g]) and _same_layouts(p, [g])):
        return None
    return p, g, moments, tree


def _scale_kw(grad_scale: torch.Tensor | None, found_inf: torch.Tensor) -> dict[str, Any]:
    return {"grad_scale": None if grad_scale is None else grad_scale.reshape(1),
            "found_inf": found_inf.reshape(1)}


class _SgdInPlace:
    """``torch._fused_sgd_`` for :func:`sgd` without dampening (state :class:`SgdState`)."""

    def __init__(self, lr: float | Schedule, momentum: float, dampening: float,
                 nesterov: bool, weight_decay: float) -> None:
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay

    def prepare(self, params: Any, grads: Any, state: Any) -> _Lists | None:
        if self.dampening != 0.0 or not isinstance(state, SgdState):
            return None
        return _lists(params, grads, lambda flat: [
            flat(state.momentum) if self.momentum != 0.0 else []])

    def run(self, prepared: _Lists, state: SgdState, grad_scale: torch.Tensor | None,
            found_inf: torch.Tensor) -> SgdState:
        p, g, (buf,), _ = prepared
        count = state.count
        finite_i = (found_inf == 0).to(count.dtype)
        lr = _lr_at(self.lr, count)
        torch._fused_sgd_(p, g, buf, weight_decay=self.weight_decay, momentum=self.momentum,
                          lr=lr, dampening=0.0, nesterov=self.nesterov, maximize=False,
                          is_first_step=False, **_scale_kw(grad_scale, found_inf))
        return state._replace(count=count + finite_i)


class _AdamInPlace:
    """``torch._fused_adam_`` / ``_fused_adamw_`` for :func:`adam` / :func:`adamw`."""

    def __init__(self, lr: float | Schedule, b1: float, b2: float, eps: float,
                 weight_decay: float, amsgrad: bool, decoupled: bool) -> None:
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.weight_decay, self.amsgrad, self.decoupled = weight_decay, amsgrad, decoupled

    def prepare(self, params: Any, grads: Any, state: Any) -> _Lists | None:
        if not isinstance(state, AdamState):
            return None
        return _lists(params, grads, lambda flat: [
            flat(state.mu), flat(state.nu), flat(state.nu_max) if self.amsgrad else []])

    def run(self, prepared: _Lists, state: AdamState, grad_scale: torch.Tensor | None,
            found_inf: torch.Tensor) -> AdamState:
        p, g, (mu, nu, nu_max), _ = prepared
        count = state.count
        finite_i = (found_inf == 0).to(count.dtype)
        lr = _lr_at(self.lr, count)
        kw = _scale_kw(grad_scale, found_inf)
        steps = [(count + 1).to(torch.float32)] * len(p)
        fn = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        fn(p, g, mu, nu, nu_max, steps, lr=lr, beta1=self.b1, beta2=self.b2,
           weight_decay=self.weight_decay, eps=self.eps, amsgrad=self.amsgrad,
           maximize=False, **kw)
        return state._replace(count=count + finite_i)


class _OnlyPartInPlace:
    """The in-place form of a :func:`chain` of one transformation (state: a 1-tuple)."""

    def __init__(self, part: _InPlace) -> None:
        self.part = part

    def prepare(self, params: Any, grads: Any, state: Any) -> Any | None:
        if type(state) is not tuple or len(state) != 1:
            return None
        return self.part.prepare(params, grads, state[0])

    def run(self, prepared: Any, state: tuple[Any], grad_scale: torch.Tensor | None,
            found_inf: torch.Tensor) -> tuple[Any]:
        return (self.part.run(prepared, state[0], grad_scale, found_inf),)


def _kernel(optimizer: GradientTransformation) -> _InPlace | None:
    update = _capability(optimizer)
    return None if update is None else update.in_place


def in_place_supported(optimizer: GradientTransformation, params: Any, grads: Any,
                       state: Any) -> bool:
    """Whether :func:`update_in_place` would run its fused kernel on these trees.

    A read-only check (nothing is written): eager mode, an optimizer with an in-place
    form (:func:`sgd` without dampening, :func:`adam`, :func:`adamw`, a :func:`chain` of
    one of them alone), uniform trees laid out as the params. Under ``torch.compile`` it
    is False: inductor fuses the pure path itself, and functionalization rejects these
    in-place kernels on a graph's inputs (torch 2.13).

    Args:
        optimizer: a :class:`GradientTransformation`.
        params: the params tree.
        grads: grads of the same structure.
        state: the optimizer state.

    Returns:
        True when :func:`update_in_place` applies.

    Example:
        >>> p = {"w": torch.ones(2)}
        >>> opt = fmp.optim.sgd(0.1, momentum=0.9)
        >>> fmp.optim.in_place_supported(opt, p, {"w": torch.ones(2)}, opt.init(p))
        True
        >>> fmp.optim.in_place_supported(opt, p, {"w": torch.ones(2, dtype=torch.float64)},
        ...                              opt.init(p))
        False
    """
    return in_place_plan(optimizer, params, grads, state) is not None


def in_place_plan(optimizer: GradientTransformation, params: Any, grads: Any,
                  state: Any) -> Any | None:
    """:func:`in_place_supported`'s check, kept for :func:`update_in_place`'s ``plan``.

    The check flattens the params, grads and moments and checks their dtypes and layouts;
    with the plan, :func:`update_in_place` flattens and checks only the grads it is given
    (which may be new tensors by then: unscaled, reduced) instead of all of it again.

    Args:
        optimizer: a :class:`GradientTransformation`.
        params: the params tree.
        grads: grads of the same structure.
        state: the optimizer state.

    Returns:
        An opaque plan, or None where :func:`in_place_supported` is False.

    Example:
        >>> p, opt = {"w": torch.ones(2)}, fmp.optim.sgd(0.1)
        >>> plan = fmp.optim.in_place_plan(opt, p, {"w": torch.ones(2)}, opt.init(p))
        >>> s = fmp.optim.update_in_place(opt, p, {"w": torch.ones(2)}, opt.init(p), None,
        ...                               torch.zeros(()), plan=plan)
        >>> p["w"]
        tensor([0.9000, 0.9000])
    """
    kernel = _kernel(optimizer)
    if kernel is None or not eager_kernels_ok():
        return None
    prepared = kernel.prepare(params, grads, state)
    return None if prepared is None else (kernel, prepared)


def update_in_place(optimizer: GradientTransformation, params: Any, grads: Any, state: Any,
                    grad_scale: torch.Tensor | None, found_inf: torch.Tensor, *,
                    plan: Any | None = None) -> Any | None:
    """Unscale, update and skip in one fused in-place pass; the new state, or None.

    The params and the moment tensors of ``state`` are overwritten with what
    ``optimizer.update`` followed by :func:`apply_updates` computes (torch's fused
    kernels: the formulas of the pure path, rounded alike on CPU), or left bit-identical
    when ``found_inf`` is 1. The grads are divided by ``grad_scale`` on the way. Nothing
    syncs the host.

    Args:
        optimizer: a :class:`GradientTransformation`.
        params: the params tree (overwritten in place).
        grads: grads of the same structure, still multiplied by ``grad_scale``.
        state: the optimizer state (its moment tensors are overwritten in place).
        grad_scale: 0-d float32 tensor the grads are divided by, or None.
        found_inf: 0-d float32 tensor, 1.0 to skip the update (nothing is written).
        plan: :func:`in_place_plan` of these params and state (and grads of the same
            trees), made since neither changed: then only ``grads`` are checked again.

    Returns:
        The new state (a new count tensor, which does not move on a skip; the moment
        trees are the same tensors), or None when :func:`in_place_supported` is False:
        then nothing has been touched and the caller runs the pure update.

    Example:
        >>> opt = fmp.optim.sgd(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> s = fmp.optim.update_in_place(opt, p, {"w": torch.ones(2)}, opt.init(p),
        ...                               None, torch.zeros(()))
        >>> p["w"], s.count
        (tensor([0.9000, 0.9000]), tensor(1, dtype=torch.int32))
    """
    if plan is not None:
        kernel, prepared = plan
        prepared = _with_grads(prepared, grads) if eager_kernels_ok() else None
    else:
        kernel = _kernel(optimizer)
        if kernel is None or not eager_kernels_ok():
            return None
        prepared = kernel.prepare(params, grads, state)
    if prepared is None:
        return None
    return kernel.run(prepared, state, grad_scale, found_inf)
