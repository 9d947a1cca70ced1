"""Tree helpers and the one leafwise prologue every transformation's ``update`` runs through.

An ``update`` flattens the grads, checks the state it was given, casts the leaves to their
compute dtypes, runs a few multi-tensor ``torch._foreach_*`` ops on the lists and rebuilds
the trees. :func:`_leafwise` does all of it but the arithmetic: a transformation is its
``body(leaves, state) -> (updates, new_state)`` over a :class:`_Leaves`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fmp import _flat_dict

_INT32_MAX = 2**31 - 1


def _flatten_params(fn: str, params: Any) -> tuple[list[torch.Tensor], Any]:
    """Flatten ``params``; every leaf must be a floating tensor (else name its path)."""
    leaves, spec = optree.tree_flatten(params)
    if not all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves):
        accessors, leaves, spec = optree.tree_flatten_with_accessor(params)
        for acc, x in zip(accessors, leaves, strict=True):
            if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
                what = (f"a {x.dtype} tensor" if isinstance(x, torch.Tensor)
                        else f"a {type(x).__name__} ({x!r})")
                raise ValueError(
                    f"{fn}.init: leaf {acc.codify('params')} is {what}; every leaf must be "
                    "a floating-point tensor (float16, bfloat16, float32, float64), or None "
                    "to leave it out"
                )
    return leaves, spec


def _flatten_like(tree: Any, spec: Any, what: str, like: str) -> list[Any]:
    """The leaves of ``tree``, which must have the structure ``spec``."""
    # Under torch.compile the check is skipped: dynamo of torch 2.11 cannot trace
    # PyTreeSpec.__eq__. A mismatch in the leaf count still fails in the foreach ops. The
    # leaves alone (the same order) then trace in half a flatten's time: dynamo's polyfill
    # of tree_flatten builds a spec object for every node, tree_leaves none.
    if torch.compiler.is_compiling():
        return _flat_dict.leaves(tree)
    leaves, tspec = optree.tree_flatten(tree)
    if tspec != spec:
        raise ValueError(
            f"{what} must have the structure of the {like}: {like} is {spec}, {what} is {tspec}"
        )
    return leaves


def _check_shapes(leaves: list[Any], like: list[Any], spec: Any, what: str,
                  like_name: str) -> None:
    """Each leaf must have the shape of its counterpart (else torch would broadcast)."""
    if [getattr(x, "shape", None) for x in leaves] == [getattr(y, "shape", None) for y in like]:
        return
    for path, x, y in zip(spec.paths(), leaves, like, strict=True):
        xs, ys = getattr(x, "shape", None), getattr(y, "shape", None)
        if xs != ys:
            xs, ys = (tuple(v) if v is not None else v for v in (xs, ys))
            raise ValueError(
                f"{what} leaf {'.'.join(map(str, path))!r} has shape {xs}"
                f" but its {like_name} has shape {ys}: the "
                "optimizer state was made for other params (rebuild it with "
                "optimizer.init(params), or TrainState.create)"
            )


def _expect_state(fn: str, state: Any, cls: type | tuple[type, ...]) -> None:
    """A clear error for a state made by another optimizer (or no state at all)."""
    if isinstance(state, cls):
        return
    names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    raise TypeError(
        f"{fn}.update: the optimizer state is a {type(state).__name__}, but {fn} needs the "
        f"{names} made by its own init; was the state made by another optimizer? Build it "
        "with this optimizer: state = optimizer.init(params) (or TrainState.create(params, "
        "optimizer, ...))"
    )


def _need_params(fn: str, params: Any, spec: Any) -> list[torch.Tensor]:
    if params is None:
        raise ValueError(f"{fn}.update needs params (weight decay uses them); got params=None")
    return _flatten_like(params, spec, "params", "grads")


def _device(leaves: list[torch.Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


def _compute_dtype(d: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    d = torch.promote_types(d, torch.float32)
    return d if state_dtype is None else torch.promote_types(d, state_dtype)


def _cast(xs: list[torch.Tensor], dts: list[torch.dtype]) -> list[torch.Tensor]:
    """Leafwise ``x.to(d)``; a leaf already of ``d`` is returned as it is (no copy)."""
    return [x if x.dtype == d else x.to(d) for x, d in zip(xs, dts, strict=True)]


def _zeros(leaves: list[torch.Tensor], state_dtype: torch.dtype | None) -> list[torch.Tensor]:
    return [torch.zeros_like(x, dtype=x.dtype if state_dtype is None else state_dtype)
            for x in leaves]


def _zeros_tree(fn: str, params: Any, state_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, Callable[[], Any]]:
    """``init``'s prologue: the zero count, and a maker of zero moment trees like the params."""
    leaves, spec = _flatten_params(fn, params)
    return _count(leaves), lambda: optree.tree_unflatten(spec, _zeros(leaves, state_dtype))


def _count(leaves: list[torch.Tensor]) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int32, device=_device(leaves))


def _increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the int32 maximum (branch-free)."""
    return torch.where(count < _INT32_MAX, count + 1, count)


def _no_leaves(spec: Any, state: Any) -> tuple[Any, Any]:
    """The update of a tree without leaves (``torch._foreach_*`` needs one): the count moves."""
    held = optree.tree_leaves([getattr(state, f) for f in getattr(state, "_fields", ())
                               if f != "count"])
    if held:
        raise ValueError(
            f"grads must have the structure of the state's moments: grads is {spec} (no "
            f"tensors), the state holds {len(held)} moment tensor(s)"
        )
    if isinstance(getattr(state, "count", None), torch.Tensor):
        state = state._replace(count=_increment(state.count))
    return optree.tree_unflatten(spec, []), state


def _add_scaled_(
    out: list[torch.Tensor], xs: list[torch.Tensor], coef: float | torch.Tensor
) -> None:
    """``out += coef * xs`` in place (``out`` must be fresh tensors owned by the caller)."""
    if isinstance(coef, torch.Tensor):
        torch._foreach_add_(out, torch._foreach_mul(xs, coef))
    else:
        torch._foreach_add_(out, xs, alpha=coef)


class _Leaves:
    """One update's grads (and params), flattened and cast to their compute dtypes.

    Attributes:
        g: the grads, each in its compute dtype.
        p: the params in the same dtypes, or None when the transformation does not read them.
        dts: the compute dtype of each leaf.
    """

    __slots__ = ("dts", "g", "p", "spec")

    def __init__(self, spec: Any, dts: list[torch.dtype], g: list[torch.Tensor],
                 p: list[torch.Tensor] | None) -> None:
        self.spec, self.dts, self.g, self.p = spec, dts, g, p

    def moments(self, tree: Any, what: str) -> tuple[list[torch.Tensor], list[torch.dtype]]:
        """A moment tree's leaves in the compute dtypes, and their stored dtypes.

        The tree must have the structure of the grads and each leaf its grad's shape.
        """
        leaves = _flatten_like(tree, self.spec, what, "grads")
        _check_shapes(leaves, self.g, self.spec, what, "grad (and param)")
        return _cast(leaves, self.dts), [x.dtype for x in leaves]

    def store(self, new: list[torch.Tensor], dtypes: list[torch.dtype]) -> Any:
        """New moments cast back to their stored dtypes, as a tree like the grads."""
        return _flat_dict.unflatten(self.spec, _cast(new, dtypes))


_Body = Callable[[_Leaves, Any], tuple[list[torch.Tensor], Any]]


def _leafwise(
    fn: str,
    body: _Body,
    *,
    state_type: type | None = None,
    state_dtype: torch.dtype | None = None,
    reads_params: bool = False,
    promote_params: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``update(grads, state, params=None)`` running ``body`` over the flattened leaves.

    Args:
        fn: the transformation's name (for errors).
        body: ``body(leaves, state) -> (updates list, new state)``.
        state_type: the state class the update needs (checked first), or None.
        state_dtype: the state dtype that takes part in the compute dtype of each leaf.
        reads_params: the update reads the params (they are flattened and cast as the grads).
        promote_params: each leaf computes in the promotion of grad, param and float32
            (else in that of grad, float32 and ``state_dtype``).
    """

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if state_type is not None:
            _expect_state(fn, state, state_type)
        g, spec = _flat_dict.flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        if promote_params:
            p = _need_params(fn, params, spec)
            dts = [_compute_dtype(torch.promote_types(a.dtype, b.dtype), None)
                   for a, b in zip(g, p, strict=True)]
            g, p = _cast(g, dts), _cast(p, dts)
        else:
            dts = [_compute_dtype(x.dtype, state_dtype) for x in g]
            g = _cast(g, dts)
            p = _cast(_need_params(fn, params, spec), dts) if reads_params else None
        updates, new_state = body(_Leaves(spec, dts, g, p), state)
        return _flat_dict.unflatten(spec, updates), new_state

    update.__qualname__ = f"{fn}.<locals>.update"
    return update
