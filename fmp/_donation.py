"""Which tensors a donated step may write into: those only fmp has handed out.

``train_step(..., donate=True)`` writes the new params, optimizer state and model state
into the input state's tensors. That is safe for tensors a donated step returned (the
caller consumes the state it passes in) and for the fresh optimizer state of
``TrainState.create``, not for tensors that came from elsewhere: the params and
buffers of :func:`fmp.functional` share storage with the module, and two states made from
one params tree share them with each other. A donated step therefore copies, once, every
such tensor it has not handed out itself; the copies are its own from then on, and the
module and the other states keep their values.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Iterator
from typing import Any

import optree
import torch

#: id -> weak reference of each tensor a step (or TrainState.create, for fresh optimizer
#: state) handed out; an entry goes when its tensor does (a plain dict: a lookup is cheap)
_OWNED: dict[int, weakref.ref] = {}


class _Gone:
    pass


#: a reference whose object is gone: what a tensor fmp did not hand out looks up
_NO_REF = weakref.ref(_Gone())


#: id -> weak reference of the step counter of each state a donated step consumed: a state
#: that still holds one is half updated (params and moments written in place, counters not)
_CONSUMED: dict[int, weakref.ref] = {}


def _forget(ref: weakref.ref, key: int) -> None:
    if _CONSUMED.get(key) is ref:
        del _CONSUMED[key]


def consume(step: Any) -> None:
    """Mark the state whose step counter is ``step`` as consumed by a donated step."""
    if isinstance(step, torch.Tensor):
        key = id(step)
        _CONSUMED[key] = weakref.ref(step, lambda r, k=key: _forget(r, k))


def release(step: Any) -> None:
    """Undo :func:`consume`: the state is whole again (a CUDA graph's state, which every
    replay updates entirely)."""
    if isinstance(step, torch.Tensor):
        _CONSUMED.pop(id(step), None)


def check_not_consumed(step: Any, where: str) -> None:
    """Raise where ``step`` is the counter of a state a donated step consumed.

    Raises:
        ValueError: naming ``where`` and the state's step, and what to pass instead.
    """
    r = _CONSUMED.get(id(step)) if isinstance(step, torch.Tensor) else None
    if r is not None and r() is step:
        raise ValueError(
            f"{where}: this state (step {int(step)}) was already consumed by a donated step "
            "(donate=True), which wrote its params and moments in place but not its "
            "counters: it is half updated. Pass the state the last call returned, or build "
            "the step with donate=False to keep old states usable")


def _owned(x: torch.Tensor) -> bool:
    r = _OWNED.get(id(x))
    return r is not None and r() is x


def claim(*trees: Any) -> None:
    """Record the tensor leaves of ``trees`` as handed out by fmp (no one else holds them)."""
    for tree in trees:
        for x in optree.tree_leaves(tree):
            if isinstance(x, torch.Tensor) and not _owned(x):
                k = id(x)
                _OWNED[k] = weakref.ref(x, lambda r, k=k: _OWNED.get(k) is r and _OWNED.pop(k))


def hand_over(tree: Any, what: str = "TrainState") -> None:
    """Record ``tree``'s tensors as given to fmp by their caller (``TrainState.create(...,
    donate=True)``): a donated step then writes into them instead of copying them first.

    Raises:
        ValueError: a tensor is already fmp's (another state or a step's output holds it:
            two states would write into one tensor), or two leaves share storage (tied or
            views of one tensor: an in-place update would be applied to it twice).
    """
    paths, all_leaves, _ = optree.tree_flatten_with_path(tree)
    named = [(".".join(map(str, p)) or "<root>", x) for p, x in zip(paths, all_leaves,
                                                                   strict=True)
             if isinstance(x, torch.Tensor)]
    seen: dict[int, str] = {}
    for name, x in named:
        if _owned(x):
            raise ValueError(f"{what} leaf {name!r} is already held by another TrainState "
                             f"or a step's output; donate=True needs tensors nothing else "
                             f"of fmp holds (pass a copy, or create without donate)")
        if x.numel() == 0:
            continue
        ptr = x.untyped_storage().data_ptr()
        if ptr in seen:
            raise ValueError(f"{what} leaves {seen[ptr]!r} and {name!r} share storage (tied "
                             f"or views of one tensor), which a donated step would update "
                             f"twice in place; create the state without donate=True (its "
                             f"first step then copies them apart)")
        seen[ptr] = name
    claim([x for _, x in named])


def all_owned(tree: Any) -> bool:
    """Whether fmp handed out every tensor leaf of ``tree`` (:func:`private` is a no-op).

    Every step asks this of its whole state, so the common answer (every leaf a tensor fmp
    handed out) is found without a Python loop over the leaves: each leaf's reference,
    dereferenced, must be the leaf itself. Anything else is decided leaf by leaf.
    """
    leaves = optree.tree_leaves(tree)
    refs = map(_OWNED.get, map(id, leaves), itertools.repeat(_NO_REF))
    if all(map(operator.is_, map(weakref.ref.__call__, refs), leaves)):
        return True
    return all(not isinstance(x, torch.Tensor) or _owned(x) for x in leaves)


def private(tree: Any) -> Any:
    """``tree`` with a copy of every tensor leaf fmp did not hand out (none: ``tree``)."""
    leaves, spec = optree.tree_flatten(tree)
    if all(not isinstance(x, torch.Tensor) or _owned(x) for x in leaves):
        return tree
    new = [x.clone() if isinstance(x, torch.Tensor) and not _owned(x) else x
           for x in leaves]
    claim(new)
    return optree.tree_unflatten(spec, new)


#: True while fmp.compile runs a step traced whole, after its host-side preparation
#: (:func:`private`): the traced step may then write into the state's tensors
_HOST_PREPARED = [False]


@contextlib.contextmanager
def prepared_on_host() -> Iterator[None]:
    """Within: the state passed to a step traced whole was made private on the host."""
    was, _HOST_PREPARED[0] = _HOST_PREPARED[0], True
    try:
        yield
    finally:
        _HOST_PREPARED[0] = was


def host_prepared() -> bool:
    """Whether the running (traced) step's state was made private on the host first."""
    return _HOST_PREPARED[0]
