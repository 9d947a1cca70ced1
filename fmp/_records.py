"""Frozen dataclass records as pytree nodes: one field table, two registrations.

A record is a ``@dataclasses.dataclass(frozen=True)`` whose fields are its field table:
a field is a *leaf* (a tensor that changes from step to step: a pytree child) unless it
is declared with :func:`static`, then it is *metadata* (a Python number carried in the
flatten context, so it survives every flatten/unflatten, torch.func transform and
torch.compile unchanged). :func:`register` reads that table once and registers the class
with optree (in the global namespace, so plain ``optree.tree_map`` sees inside) and with
torch's pytree (so ``torch.func`` and ``torch.compile(fullgraph=True)`` see inside), both
with the same children in the same order and the same metadata:

- children: the leaf fields, in declaration order (path entries / keys: their names);
- metadata: the tuple of the static fields' values, or None for a record without any.

Unflattening builds the record with :func:`unchecked`: no validation, no conversion (the
children may be tracers, batched tensors or anything a transform maps them to). Validation
belongs to the record's constructor, ``create`` and ``from_state_dict`` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import optree
import torch.utils._pytree as _torch_pytree

R = TypeVar("R")

_GLOBAL_NAMESPACE: str = getattr(optree.registry, "__GLOBAL_NAMESPACE")
_STATIC = "fmp.static"
_TABLE = "_fmp_field_table"


def static(default: Any = dataclasses.MISSING) -> Any:
    """A record field that is metadata (part of the tree structure), not a leaf.

    Args:
        default: the field's default value (none: the field is required).

    Returns:
        A ``dataclasses.field`` marked static.

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class R:
        ...     x: torch.Tensor
        ...     n: int = static(3)
        >>> field_table(R)
        (('x',), ('n',))
    """
    return dataclasses.field(default=default, metadata={_STATIC: True})


def field_table(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(leaf field names, static field names)`` of a record class, in declaration order.

    Args:
        cls: a dataclass.

    Returns:
        The two tuples of names.

    Example:
        >>> field_table(fmp.DynamicLossScale)[0]
        ('loss_scale', 'counter', 'overflows')
    """
    table = getattr(cls, _TABLE, None)  # a registered record: computed once, at registration
    if table is not None:
        return table
    fields = dataclasses.fields(cls)
    leaves = tuple(f.name for f in fields if not f.metadata.get(_STATIC, False))
    meta = tuple(f.name for f in fields if f.metadata.get(_STATIC, False))
    return leaves, meta


def unchecked(cls: type[R], leaves: Iterable[Any], meta: Iterable[Any] | None = ()) -> R:
    """A record of ``cls`` from its leaf and static values, with no check or conversion.

    Args:
        cls: a registered record class.
        leaves: the leaf values, in :func:`field_table` order.
        meta: the static values, in :func:`field_table` order (None: there are none).

    Returns:
        The record.

    Example:
        >>> unchecked(fmp.StaticLossScale, [torch.tensor(4.0)]).loss_scale
        tensor(4.)
    """
    names_l, names_m = field_table(cls)
    obj = object.__new__(cls)
    for name, value in zip(names_l, leaves, strict=True):
        object.__setattr__(obj, name, value)
    for name, value in zip(names_m, () if meta is None else meta, strict=True):
        object.__setattr__(obj, name, value)
    return obj


def as_dict(record: Any) -> dict[str, Any]:
    """The record's fields by name, leaves then static fields (in table order).

    Example:
        >>> as_dict(fmp.StaticLossScale(2.0))
        {'loss_scale': tensor(2.)}
    """
    leaves, meta = field_table(type(record))
    return {n: getattr(record, n) for n in (*leaves, *meta)}


def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
    """:func:`as_dict`'s inverse (unchecked); KeyError names a missing field.

    Example:
        >>> from_dict(fmp.StaticLossScale, {"loss_scale": torch.tensor(2.0)}).loss_scale
        tensor(2.)
    """
    leaves, meta = field_table(cls)
    return unchecked(cls, [d[n] for n in leaves], [d[n] for n in meta])


def register(cls: type[R]) -> type[R]:
    """Register a record class with optree and torch's pytree from its field table.

    The torch registration's ``serialized_type_name`` is ``module.qualname`` of the class
    (so ``treespec_dumps`` output names the public path when ``__module__`` is public).

    Args:
        cls: a frozen dataclass.

    Returns:
        ``cls`` (usable as a decorator).
    """
    leaves, meta = field_table(cls)
    setattr(cls, _TABLE, (leaves, meta))

    def children(obj: Any) -> list[Any]:
        return [getattr(obj, n) for n in leaves]

    def context(obj: Any) -> tuple[Any, ...] | None:
        return tuple(getattr(obj, n) for n in meta) if meta else None

    def build(kids: Iterable[Any], ctx: Any) -> Any:
        return unchecked(cls, kids, None if ctx is None else tuple(ctx))

    optree.register_pytree_node(
        cls,
        lambda obj: (children(obj), context(obj), leaves),
        lambda ctx, kids: build(kids, ctx),
        path_entry_type=optree.GetAttrEntry,
        namespace=_GLOBAL_NAMESPACE,
    )
    dumpable: dict[str, Any] = (
        {"to_dumpable_context": list, "from_dumpable_context": tuple} if meta else {})
    _torch_pytree.register_pytree_node(
        cls,
        lambda obj: (children(obj), context(obj)),
        build,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: (
            [(_torch_pytree.GetAttrKey(n), getattr(obj, n)) for n in leaves], context(obj)),
        **dumpable,
    )
    return cls


def with_leaves(record: R, leaves: Iterable[Any]) -> R:
    """A record of the same class and static values with new leaves (unchecked).

    Example:
        >>> with_leaves(fmp.StaticLossScale(2.0), [torch.tensor(8.0)]).loss_scale
        tensor(8.)
    """
    _, meta = field_table(type(record))
    return unchecked(type(record), leaves, [getattr(record, n) for n in meta])
