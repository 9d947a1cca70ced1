"""The params' compute-dtype copy a train step keeps, and the check that it is still current.

A mixed-precision step casts every param to the compute dtype in the forward and converts
every grad back in the backward. A step that keeps the cast params in its state
(``TrainState.compute_params``), written by the update from the new params, skips both:
the forward reads the copy, the grads arrive in the compute dtype and the update converts
them (the same values the cast's backward gives).

A copy that no longer matches its params would train on old weights without any error, so
the step uses one only when it can tell it is current: the copy was written by a step of
this process with the same casts (a stamp kept here, outside the state, so checkpoints and
pytrees carry none) from these very param tensors, and neither they nor the copy were
modified in place since (their version counters). Anything else (new params in a replaced
state, a loaded checkpoint, an in-place edit, a ``tree_map`` over the state) rebuilds the
copy from the params. Writes through ``.data`` bypass version counters: after those, pass
``state._replace(compute_params=None)`` to rebuild it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["current_copy", "stamp"]


class _Stamp(NamedTuple):
    cast: weakref.ref
    params: tuple[weakref.ref, ...]
    copies: tuple[weakref.ref, ...]
    versions: tuple[int, ...]


#: first cast leaf of a copy -> what it was written from (dropped with the copy)
_STAMPS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _pairs(params: Any, copy: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The (param, copy) tensor pairs that differ (the cast ones); None if the trees differ."""
    p_leaves, spec = optree.tree_flatten(params)
    c_leaves, c_spec = optree.tree_flatten(copy)
    if c_spec != spec:
        return None
    ps, cs = [], []
    for p, c in zip(p_leaves, c_leaves, strict=True):
        if c is not p:
            if not (isinstance(p, torch.Tensor) and isinstance(c, torch.Tensor)):
                return None
            ps.append(p)
            cs.append(c)
    return ps, cs


def _versions(ps: list[torch.Tensor], cs: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t._version for t in ps) + tuple(t._version for t in cs)


def stamp(params: Any, copy: Any, cast: Callable[[Any], Any]) -> None:
    """Record that ``copy`` was just written as ``cast(params)`` (by a step's update)."""
    pairs = _pairs(params, copy)
    if not pairs or not pairs[1]:
        return
    ps, cs = pairs
    _STAMPS[cs[0]] = _Stamp(weakref.ref(cast), tuple(weakref.ref(p) for p in ps),
                            tuple(weakref.ref(c) for c in cs), _versions(ps, cs))


def _is_current(params: Any, copy: Any, cast: Callable[[Any], Any]) -> bool:
    pairs = _pairs(params, copy)
    if not pairs or not pairs[1]:
        return False
    ps, cs = pairs
    rec = _STAMPS.get(cs[0])
    return (rec is not None and rec.cast() is cast and len(rec.params) == len(ps)
            and all(r() is p for r, p in zip(rec.params, ps, strict=True))
            and all(r() is c for r, c in zip(rec.copies, cs, strict=True))
            and rec.versions == _versions(ps, cs))


def current_copy(params: Any, copy: Any, cast: Callable[[Any], Any]) -> Any:
    """``copy`` if it is current for ``params``, else a new one (``cast(params)``).

    Returns None when the cast changes no leaf (nothing to keep).
    """
    if copy is not None and _is_current(params, copy, cast):
        return copy
    new = cast(params)
    p_leaves = optree.tree_leaves(params)
    if all(c is p for c, p in zip(optree.tree_leaves(new), p_leaves, strict=True)):
        return None
    return new
