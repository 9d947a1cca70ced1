"""optax's pair of pure functions, the capabilities an ``update`` may carry, apply_updates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optree
import torch

from fmp import _flat_dict
from fmp.optim._leafwise import _cast, _check_shapes, _flatten_like


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init`` builds the state, ``update`` transforms grads.

    Attributes:
        init: ``init(params) -> state``; the state is a NamedTuple of tensors (or a tuple
            of such for :func:`chain`).
        update: ``update(grads, state, params=None) -> (updates, new_state)``. ``updates``
            has the structure of ``grads``; add it to the params with
            :func:`apply_updates`. ``params`` is needed by transformations that use the
            weights (weight decay) and is otherwise ignored.

    The ``update`` of :func:`sgd`, :func:`adam`, :func:`adamw` (and of :func:`chain` where
    its parts allow it) also knows an in-place form (:func:`update_in_place`) and the check
    of its learning-rate schedule (:func:`schedule_ok`); any other callable is a plain
    update without them.

    Example:
        >>> opt = fmp.optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> fmp.optim.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class _InPlace(Protocol):
    """An in-place fused form of an update (see ``fmp.optim._inplace``)."""

    def prepare(self, params: Any, grads: Any, state: Any) -> Any | None:
        """What :meth:`run` needs (the leaf lists), or None when the kernel does not apply."""

    def run(self, prepared: Any, state: Any, grad_scale: torch.Tensor | None,
            found_inf: torch.Tensor) -> Any:
        """Update the prepared params and moments in place; return the new state."""


class _Update:
    """An ``update`` function together with the capabilities of its transformation.

    Calling it calls the function. ``schedule_check(state) -> 0-d bool tensor`` says
    whether the scheduled learning rate the next update reads is usable (None: no
    schedule); ``in_place`` is its fused in-place form (None: none).
    """

    __slots__ = ("_fn", "in_place", "schedule_check")

    def __init__(self, fn: Callable[..., tuple[Any, Any]], *,
                 schedule_check: Callable[[Any], torch.Tensor] | None = None,
                 in_place: _InPlace | None = None) -> None:
        self._fn = fn
        self.schedule_check = schedule_check
        self.in_place = in_place

    def __call__(self, grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return self._fn(grads, state, params)

    def __repr__(self) -> str:
        return f"<update of {self._fn.__qualname__.split('.<locals>')[0]}>"


def _capability(optimizer: GradientTransformation) -> _Update | None:
    """The optimizer's update as an :class:`_Update`, or None for a plain callable."""
    update = optimizer.update
    return update if isinstance(update, _Update) else None


def apply_updates(params: Any, updates: Any) -> Any:
    """Add ``updates`` to ``params`` leafwise; each result has its param's dtype.

    The sum is computed in the promoted dtype of the param and its update (for a bf16 or
    fp16 param and a float32 update: in float32, then rounded once to the param's dtype),
    with one multi-tensor ``torch._foreach_add``. Pure: the inputs are not modified.

    Args:
        params: a pytree of floating tensors.
        updates: a pytree of the same structure (as returned by an ``update``).

    Returns:
        A new tree of the params' structure; leaf ``i`` has the dtype of ``params`` leaf
        ``i``.

    Raises:
        ValueError: the trees differ in structure (the message shows both), or a leaf
            is not a tensor.

    Example:
        >>> p = {"w": torch.ones(2, dtype=torch.bfloat16)}
        >>> fmp.optim.apply_updates(p, {"w": torch.full((2,), 0.5)})["w"]
        tensor([1.5000, 1.5000], dtype=torch.bfloat16)
    """
    p, spec = _flat_dict.flatten(params)
    u = _flatten_like(updates, spec, "updates", "params")
    if not p:
        return optree.tree_unflatten(spec, [])
    for i, (a, b) in enumerate(zip(p, u, strict=True)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise ValueError(
                f"apply_updates: leaf {i} must be a tensor in params and updates, got "
                f"{type(a).__name__} and {type(b).__name__}"
            )
    _check_shapes(u, p, spec, "updates", "param")
    dts = [torch.promote_types(a.dtype, b.dtype) for a, b in zip(p, u, strict=True)]
    out = torch._foreach_add(_cast(p, dts), _cast(u, dts))
    return _flat_dict.unflatten(spec, _cast(out, [a.dtype for a in p]))
