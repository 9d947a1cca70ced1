"""Apex's function registry: the cast decorators and ``register_*_function``, one implementation.

``half_function(fn)`` / ``float_function(fn)`` / ``promote_function(fn)`` wrap a function
with one of Apex's cast rules: its floating arguments go to the low dtype, to float32, or
to the widest floating dtype among them. While the O1 casts are on
(:mod:`adapters.apex.amp._o1_install`) the rule is the O1 mode's; elsewhere, while
``torch.autocast`` is on for the device of the tensor arguments, the arguments are cast
(:func:`fmp.cast_tree`) and ``fn`` runs with autocast off; else ``fn`` runs unchanged.

``register_*_function(module, name)`` records ``(module, name, kind)`` in its owner's
registry (an ``Amp``'s ``_registry``); :func:`apply_registration` applies one record to an
O1 mode: a function of ``torch``, ``torch.nn.functional`` or ``torch.Tensor`` becomes a
rule of the mode, anything else is replaced in place by :func:`cast_function`'s wrapper
(undone when the mode is uninstalled). The ``Amp`` methods, the module functions of
:mod:`adapters.apex.amp` and ``amp.init``'s handle all come here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import optree
import torch
import torch.nn.functional as F

import fmp
from adapters.apex.amp import _o1_install
from adapters.apex.amp._errors import AmpError
from adapters.apex.amp._o1_mode import O1Mode

Kind = Literal["half", "float", "promote"]

_KINDS = ("half", "float", "promote")
_NAMESPACES = (torch, F, torch.Tensor, torch.nn.functional)


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


def cast_function(fn: Callable[..., Any], kind: Kind, name: str | None = None,
                  autocast: bool = True) -> Callable[..., Any]:
    """Wrap ``fn`` with one of Apex's cast rules (see the module docstring).

    Args:
        fn: the function.
        kind: ``"half"``, ``"float"`` or ``"promote"``.
        name: the name the O1 mode logs the casts under (default ``fn.__name__``).
        autocast: outside the O1 casts, follow ``torch.autocast`` (the decorators); False:
            run ``fn`` unchanged there (a function registered in place, as in Apex).

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
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'half', 'float' or 'promote', got {kind!r}")
    label = name if name is not None else getattr(fn, "__name__", "function")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _o1_install.active_low_dtype() is not None:
            return _o1_install.call_cast(fn, kind, label, args, kwargs)
        if not autocast:
            return fn(*args, **kwargs)
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


def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: under autocast, run ``fn`` on arguments cast to autocast's low dtype.

    Args:
        fn: the function.

    Returns:
        The wrapper; outside autocast it calls ``fn`` unchanged.

    Example:
        >>> from adapters.apex.amp import Amp
        >>> f = Amp.half_function(torch.add)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     f(torch.ones(1), torch.ones(1)).dtype
        torch.float16
    """
    return cast_function(fn, "half")


def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: under autocast, run ``fn`` on arguments cast to float32.

    Args:
        fn: the function.

    Returns:
        The wrapper.

    Example:
        >>> from adapters.apex.amp import Amp
        >>> f = Amp.float_function(torch.mm)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     f(torch.ones(2, 2), torch.ones(2, 2)).dtype
        torch.float32
    """
    return cast_function(fn, "float")


def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: under autocast, cast floating arguments to the widest of their dtypes.

    Args:
        fn: the function.

    Returns:
        The wrapper.

    Example:
        >>> from adapters.apex.amp import Amp
        >>> f = Amp.promote_function(torch.cat)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     f([torch.ones(1, dtype=torch.float16), torch.ones(1)]).dtype
        torch.float32
    """
    return cast_function(fn, "promote")


def apply_registration(mode: O1Mode, owner: Any, name: str, kind: Kind) -> None:
    """Make ``owner.name`` follow rule ``kind`` (``half``/``float``/``promote``) under ``mode``.

    A function of ``torch``, ``torch.nn.functional`` or ``torch.Tensor`` becomes a rule of
    the mode; anything else is replaced by a casting wrapper (undone by
    :func:`~adapters.apex.amp._o1_install.uninstall`). A function wrapped before stays.

    Example:
        >>> m = O1Mode(torch.float16, "cpu")
        >>> apply_registration(m, torch, "sigmoid", "float")
        >>> with m:
        ...     torch.sigmoid(torch.ones(1, dtype=torch.float16)).dtype
        torch.float32
    """
    fn = getattr(owner, name)
    if getattr(fn, "_amp_cast_kind", None) is not None:
        return
    if any(owner is ns for ns in _NAMESPACES) and (
            isinstance(fn, type(torch.mm) | type(torch.Tensor.mm))
            or getattr(fn, "__module__", "").startswith("torch")):
        mode.user_rules[fn] = (kind, name)
        return
    mode.patches.append((owner, name, fn))
    setattr(owner, name, cast_function(fn, kind, name, autocast=False))


def apply_registry(mode: O1Mode, registry: list[tuple[Any, str, Kind]]) -> None:
    """Apply every ``(module, name, kind)`` record of ``registry`` to ``mode``.

    Example:
        >>> import types
        >>> ns = types.SimpleNamespace(f=abs)
        >>> apply_registry(O1Mode(torch.float16, "cpu"), [(ns, "f", "float")])
        >>> ns.f.__wrapped__ is abs
        True
    """
    for module, name, kind in registry:
        apply_registration(mode, module, name, kind)


def register(owner: Any, registry: list[tuple[Any, str, Kind]], module: Any, name: str,
             kind: Kind) -> None:
    """Record a ``register_*_function`` call of ``owner``; apply it now if its mode is on.

    Args:
        owner: the ``Amp`` whose registry it is.
        registry: that registry.
        module: a module or any object holding the function.
        name: the attribute name.
        kind: ``"half"``, ``"float"`` or ``"promote"``.

    Raises:
        AmpError: ``module`` has no attribute ``name``.

    Example:
        >>> import types
        >>> reg: list = []
        >>> register(object(), reg, types.SimpleNamespace(f=abs), "f", "float")
        >>> len(reg)
        1
    """
    if not hasattr(module, name):
        raise AmpError(f"no function named {name!r} in {module!r}")
    registry.append((module, name, kind))
    m = _o1_install.current()
    if m is not None and getattr(m, "owner", None) is owner:
        apply_registration(m, module, name, kind)
