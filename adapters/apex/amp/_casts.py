"""Apex's user cast annotations on top of torch.autocast.

``half_function(fn)`` / ``float_function(fn)`` / ``promote_function(fn)`` wrap a function
so that, while autocast is on for the device of its tensor arguments, its floating
arguments are cast (to autocast's low dtype, to float32, or to the widest floating dtype
among them) and it runs with autocast off. Outside autocast the wrapper calls ``fn``
unchanged. The casts are :func:`fmp.cast_tree`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch

import fmp

__all__ = ["Kind", "cast_function", "disable_casts"]

Kind = Literal["half", "float", "promote"]


def _device_type(args: Any) -> str | None:
    for leaf in optree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return None


def _active(device_type: str | None) -> str | None:
    """The device type whose autocast is on for these arguments, or None."""
    candidates = [device_type] if device_type else ["cuda", "cpu"]
    for d in candidates:
        if torch.is_autocast_enabled(d):
            return d
    return None


def _widest(args: Any) -> torch.dtype | None:
    widest: torch.dtype | None = None
    for leaf in optree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            widest = leaf.dtype if widest is None else torch.promote_types(widest, leaf.dtype)
    return widest


def cast_function(fn: Callable[..., Any], kind: Kind) -> Callable[..., Any]:
    """Wrap ``fn`` with one of Apex's cast rules (see the module docstring).

    Args:
        fn: the function.
        kind: ``"half"``, ``"float"`` or ``"promote"``.

    Returns:
        The wrapper (``functools.wraps(fn)``; ``wrapper.__wrapped__`` is ``fn``).

    Raises:
        ValueError: an unknown ``kind``.

    Example:
        >>> f = cast_function(torch.add, "float")
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     f(torch.ones(1, dtype=torch.float16), 1).dtype
        torch.float32
    """
    if kind not in ("half", "float", "promote"):
        raise ValueError(f"kind must be 'half', 'float' or 'promote', got {kind!r}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from adapters.apex.amp import _o1_install  # [amp14a] the O1 mode's casts

        if _o1_install.active_low_dtype() is not None:
            return _o1_install.call_cast(fn, kind, getattr(fn, "__name__", "function"),
                                         args, kwargs)
        device_type = _active(_device_type((args, kwargs)))
        if device_type is None:
            return fn(*args, **kwargs)
        if kind == "half":
            target: torch.dtype | None = torch.get_autocast_dtype(device_type)
        elif kind == "float":
            target = torch.float32
        else:
            target = _widest((args, kwargs))
        if target is not None:
            args, kwargs = fmp.cast_tree((args, kwargs), target)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    wrapper._amp_cast_kind = kind  # type: ignore[attr-defined]
    return wrapper


class disable_casts:
    """Context manager: no autocast casts inside (``torch.autocast(enabled=False)``).

    Args:
        device_type: the device type whose autocast is turned off.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.float16), disable_casts("cpu"):
        ...     torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """

    def __init__(self, device_type: str) -> None:
        self._ctx = torch.autocast(device_type, enabled=False)

    def __enter__(self) -> None:
        self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
