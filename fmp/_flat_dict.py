"""optree's flatten and unflatten, with a short path for a flat dict of tensors under dynamo.

Under ``torch.compile`` dynamo runs ``optree.tree_flatten`` through its Python polyfill,
which builds a spec object per node and looks each node's type up in the registry: about
5,000 traced lines for GPT-2's 148-tensor params dict, and an update traces several such
trees (grads, params, moments). The params of :func:`fmp.functional` are such a dict. For
one (``type(tree) is dict``, every value a tensor), the leaves are the values in sorted key
order, as optree orders a dict, and the spec is :class:`DictSpec` (the sorted keys). Any
other tree, and every tree outside dynamo, goes through optree itself.
"""

from __future__ import annotations

from typing import Any

import optree
import torch


class DictSpec:
    """The spec of a flat dict of tensors: its keys sorted as optree orders the leaves,
    and in the dict's own order (what unflatten gives back)."""

    __slots__ = ("keys", "order")

    def __init__(self, keys: tuple[Any, ...], order: tuple[Any, ...]) -> None:
        self.keys, self.order = keys, order

    def paths(self) -> list[tuple[Any, ...]]:
        return [(k,) for k in self.keys]

    def __repr__(self) -> str:
        return f"DictSpec({list(self.keys)!r})"


def _flat(tree: Any) -> bool:
    return (type(tree) is dict and len(tree) > 0
            and all(isinstance(v, torch.Tensor) for v in tree.values())
            and all(type(k) is str for k in tree))


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``optree.tree_flatten(tree)``; a :class:`DictSpec` for a flat dict under dynamo."""
    if torch.compiler.is_compiling() and _flat(tree):
        keys = tuple(sorted(tree))
        return [tree[k] for k in keys], DictSpec(keys, tuple(tree))
    return optree.tree_flatten(tree)


def leaves(tree: Any) -> list[Any]:
    """``optree.tree_leaves(tree)``, with the short path of :func:`flatten`."""
    if torch.compiler.is_compiling() and _flat(tree):
        return [tree[k] for k in sorted(tree)]
    return optree.tree_leaves(tree)


def unflatten(spec: Any, leaves: list[Any]) -> Any:
    """``optree.tree_unflatten(spec, leaves)``, for a :class:`DictSpec` too."""
    if isinstance(spec, DictSpec):
        if len(leaves) != len(spec.keys):
            raise ValueError(f"{len(leaves)} leaves for a spec of {len(spec.keys)} keys")
        by_key = dict(zip(spec.keys, leaves, strict=True))
        return {k: by_key[k] for k in spec.order}
    return optree.tree_unflatten(spec, leaves)
