"""Casting the floating tensors inside a model's output, whatever holds them.

Apex cast the tensors of outputs nested in lists, tuples and mappings. Outputs of Hugging
Face models are ``ModelOutput`` objects (ordered-dict dataclasses) that optree treats as
one leaf; here they, other dataclasses, named tuples and mappings are walked too, and each
comes back as the same type (``out.loss`` and ``out["logits"]`` keep working).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


def cast_nested(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``cast`` applied to each tensor it holds, containers rebuilt as their type.

    Args:
        value: a tensor, or a list/tuple/named tuple/mapping/dataclass (e.g. a Hugging Face
            ``ModelOutput``) holding tensors at any depth; anything else is returned as is.
        cast: applied to each tensor.

    Returns:
        The cast structure (new containers; the input is not changed).

    Example:
        >>> out = {"logits": [torch.ones(1, dtype=torch.float16)], "n": 3}
        >>> cast_nested(out, lambda t: t.float())["logits"][0].dtype
        torch.float32
    """
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, str | bytes):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Hugging Face's ModelOutput is a dataclass and an OrderedDict: replace rebuilds it
        changes = {f.name: cast_nested(getattr(value, f.name), cast)
                   for f in dataclasses.fields(value) if f.init and hasattr(value, f.name)}
        return dataclasses.replace(value, **changes)
    if isinstance(value, Mapping):
        items = {k: cast_nested(v, cast) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(cast_nested(v, cast) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(cast_nested(v, cast) for v in value)
    return value
