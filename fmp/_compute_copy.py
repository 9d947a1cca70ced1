"""The params' compute-dtype copy a train step keeps, and the check that it is still current.

A mixed-precision step casts every param to the compute dtype in the forward and converts
every grad back in the backward. A step that keeps the cast params in its state
(``TrainState.compute_params``), written by the update from the new params, skips both:
the forward reads the copy, the grads arrive in the compute dtype and the update converts
them (the same values the cast's backward gives).

A copy that no longer matches its params would train on old weights without any error, so
the step uses one only when it can tell it is current: the copy was written by this very
step (a stamp kept in the step's :class:`CopyStamps`, outside the state, so checkpoints and
pytrees carry none) from these very param tensors, and neither they nor the copy were
modified in place since (their version counters). Anything else (new params in a replaced
state, a loaded checkpoint, an in-place edit, a ``tree_map`` over the state) rebuilds the
copy from the params. Writes through ``.data`` bypass version counters: after those, pass
``state._replace(compute_params=None)`` to rebuild it.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils.weak import WeakIdKeyDictionary

_version = operator.attrgetter("_version")


class _Stamp:
    """What a copy was written from: the tensors' ids and versions, and whether they live.

    An id names one object only while that object is alive, so the record holds weak
    references whose callbacks mark it dead as soon as any of its tensors is freed; with
    that, a check is two tuple comparisons.
    """

    __slots__ = ("alive", "ids", "refs", "versions")

    def __init__(self, tensors: list[torch.Tensor], ids: tuple[int, ...],
                 versions: tuple[int, ...]) -> None:
        self.alive = True
        self.ids = ids
        self.versions = versions
        self.refs = [weakref.ref(t, self._dead) for t in tensors]

    def _dead(self, _ref: weakref.ref) -> None:
        self.alive = False


def _cast_tensors(params: Any, copy: Any) -> list[torch.Tensor] | None:
    """The copy's cast leaves then their params (leaves that differ); None if trees differ.

    A flat dict of tensors (what :func:`fmp.functional` gives) is read directly, in one
    pass: optree would sort its keys every step."""
    if type(params) is dict and type(copy) is dict:
        if params.keys() != copy.keys():
            return None
        cs, ps = [], []
        for k, p in params.items():
            c = copy[k]
            if type(c) is not torch.Tensor or type(p) is not torch.Tensor:
                break  # not all plain tensors: the general path below
            if c is not p:
                cs.append(c)
                ps.append(p)
        else:
            return cs + ps if cs else None
    p_leaves, spec = optree.tree_flatten(params)
    c_leaves, c_spec = optree.tree_flatten(copy)
    if c_spec != spec:
        return None
    pairs = [(c, p) for c, p in zip(c_leaves, p_leaves, strict=True) if c is not p]
    if not pairs or not all(isinstance(c, torch.Tensor) and isinstance(p, torch.Tensor)
                            for c, p in pairs):
        return None
    return [c for c, _ in pairs] + [p for _, p in pairs]


class CopyStamps:
    """The stamps of the compute copies one step wrote (one per step: no process-global
    registry). ``cast`` is the step's cast of params to compute dtypes."""

    def __init__(self, cast: Callable[[Any], Any]) -> None:
        self.cast = cast
        #: first cast leaf of a copy -> its stamp (an entry goes with its copy)
        self._stamps: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: the stamp the last check found current or the last stamp wrote, else None
        self._last: _Stamp | None = None

    def __len__(self) -> int:
        return len(self._stamps)

    def stamp(self, params: Any, copy: Any) -> None:
        """Record that ``copy`` was just written as ``cast(params)`` (by the step's update)."""
        self._last = None
        ts = _cast_tensors(params, copy)
        if ts is None:
            return
        ids, versions = tuple(map(id, ts)), tuple(map(_version, ts))
        rec = self._stamps.get(ts[0])
        if rec is not None and rec.alive and rec.ids == ids:
            rec.versions = versions  # the same tensors (a donated step): new versions only
        else:
            rec = self._stamps[ts[0]] = _Stamp(ts, ids, versions)
        self._last = rec

    def restamp(self) -> None:
        """:meth:`stamp` for the very trees (the same dicts and tensors) that the last check
        found current or the last stamp recorded, written in place since (a donated step):
        their new versions, without walking the trees again."""
        rec, self._last = self._last, None
        if rec is not None and rec.alive:
            rec.versions = tuple(_version(r()) for r in rec.refs)
            self._last = rec

    def _is_current(self, params: Any, copy: Any) -> bool:
        self._last = None
        ts = _cast_tensors(params, copy)
        if ts is None:
            return False
        rec = self._stamps.get(ts[0])
        if (rec is not None and rec.alive and rec.ids == tuple(map(id, ts))
                and rec.versions == tuple(map(_version, ts))):
            self._last = rec
            return True
        return False

    def current_copy(self, params: Any, copy: Any) -> Any:
        """``copy`` if it is current for ``params``, else a new one (``cast(params)``).

        Returns None when the cast changes no leaf (nothing to keep).
        """
        if copy is not None and self._is_current(params, copy):
            return copy
        new = self.cast(params)
        p_leaves = optree.tree_leaves(params)
        if all(c is p for c, p in zip(optree.tree_leaves(new), p_leaves, strict=True)):
            return None
        return new
