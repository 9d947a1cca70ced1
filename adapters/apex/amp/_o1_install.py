"""Installing the O1 mode (:class:`~adapters.apex.amp._o1_mode.O1Mode`) and the hooks on it.

One mode at a time, as Apex had one handle: it sits at the bottom of this thread's torch
function mode stack (above torch's ``DeviceContext``), so ``with`` blocks of other modes
entered before or after it push and pop around it. Its owner (an ``Amp``, or the handle
of ``amp.init``) holds the ``register_*_function`` registrations, which the function
registry (:mod:`adapters.apex.amp._functions`) applies to the mode.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch

from adapters.apex.amp import _o1_stack
from adapters.apex.amp._o1_mode import O1Mode, _rules, _types

_CURRENT: O1Mode | None = None


# ---------------------------------------------------------------------------------------
# installing the mode on the stack
# ---------------------------------------------------------------------------------------
def current() -> O1Mode | None:
    """The installed O1 mode, or None.

    Example:
        >>> current() is None or isinstance(current(), O1Mode)
        True
    """
    return _CURRENT


def install(mode: O1Mode) -> O1Mode:
    """Install ``mode`` (replacing the one installed before, whose patches are undone).

    Args:
        mode: the mode.

    Returns:
        ``mode``.

    Example:
        >>> m = install(O1Mode(torch.float16, "cpu"))
        >>> torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype
        torch.float16
        >>> uninstall()
    """
    global _CURRENT
    uninstall()
    _o1_stack.rebuild(lambda m: not isinstance(m, O1Mode), mode)
    _CURRENT = mode
    _patch_rnn_input_check(mode)
    return mode


def _patch_rnn_input_check(mode: O1Mode) -> None:
    """Let ``nn.RNN``/``LSTM``/``GRU`` take a half input beside float32 weights under ``mode``.

    torch's modules refuse an input whose dtype differs from their weights' unless autocast
    is on; under the O1 casts the RNN runs in half anyway (its ``torch.lstm``-level call is
    cast, weights and all, as Apex's was), so the check sees the weights' dtype instead.
    Undone by :func:`uninstall`.
    """
    rnn_base = torch.nn.modules.rnn.RNNBase
    orig = rnn_base.check_input

    @functools.wraps(orig)
    def check_input(self: Any, input: torch.Tensor, batch_sizes: Any) -> None:
        weights = getattr(self, "_flat_weights", None)
        w = weights[0] if weights else None
        if _CURRENT is mode and getattr(mode, "active", True) and \
                isinstance(w, torch.Tensor) and input.dtype != w.dtype and \
                {input.dtype, w.dtype} <= {mode.low, torch.float32}:
            input = torch.empty(input.shape, dtype=w.dtype, device="meta")
        return orig(self, input, batch_sizes)

    mode.patches.append((rnn_base, "check_input", orig))
    rnn_base.check_input = check_input


def uninstall() -> None:
    """Remove the installed O1 mode (if any) and undo its in-place wrappers.

    Example:
        >>> uninstall(); current() is None
        True
    """
    global _CURRENT
    mode, _CURRENT = _CURRENT, None
    _o1_stack.rebuild(lambda m: not isinstance(m, O1Mode))
    if mode is not None:
        _o1_stack.forget(mode)
        for owner, name, fn in reversed(mode.patches):
            setattr(owner, name, fn)
        mode.patches.clear()
        mode.clear_cache()


# ---------------------------------------------------------------------------------------
# calls under the installed mode's rules (the function registry's wrappers come here)
# ---------------------------------------------------------------------------------------
def cast_args(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              name: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments cast by rule ``kind`` under the installed mode; None when it is off.

    Example:
        >>> cast_args("half", (torch.ones(1),), {}, "f") is None or True
        True
    """
    m = _CURRENT
    if m is None or not m.active:
        return None
    if kind == "half":
        return m.half_args(args, kwargs, name)
    if kind == "float" or m._mixed(_types(args, kwargs)):
        return m.float_args(args, kwargs, name)
    return args, kwargs


def call_cast(fn: Any, kind: str, name: str, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` on the arguments cast by rule ``kind`` (unchanged when no mode is on).

    A torch function that has a rule of its own runs with the casts off (Apex wrapped the
    original, unpatched function); any other function runs with them on.

    Example:
        >>> call_cast(torch.mm, "float", "mm", (torch.ones(1, 1), torch.ones(1, 1)), {}).dtype
        torch.float32
    """
    cast = cast_args(kind, args, kwargs, name)
    if cast is None:
        return fn(*args, **kwargs)
    m = _CURRENT
    assert m is not None
    try:
        own = fn in m.user_rules or fn in _rules()
    except TypeError:  # an unhashable callable
        own = False
    if not own:
        return fn(*cast[0], **cast[1])
    with m.casts(False), torch.autocast(m.device_type, enabled=False):
        return fn(*cast[0], **cast[1])


def _no_casts_in_step(optimizer: Any) -> None:
    """Run ``optimizer.step`` with the casts off and the cache dropped (as Apex did)."""
    if getattr(optimizer, "_amp_o1_step", False):
        return
    # kept on the optimizer (not in a closure), so that a deepcopy steps its own copy
    optimizer._amp_o1_inner_step = optimizer.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        m = _CURRENT
        if m is None:
            return self._amp_o1_inner_step(*args, **kwargs)
        m.clear_cache()
        with m.casts(False):
            return self._amp_o1_inner_step(*args, **kwargs)

    # a bound method, as LR schedulers expect (they wrap ``step.__func__``)
    optimizer.step = types.MethodType(step, optimizer)
    optimizer._amp_o1_step = True
    _no_casts_in_zero_grad(optimizer)


def _no_casts_in_zero_grad(optimizer: Any) -> None:
    """Run torch's own ``zero_grad`` with the casts off: it calls nothing on Apex's lists
    (grads set to None, ``detach_``/``requires_grad_``/``_foreach_zero_``), so the results
    are the same, without a trip through the mode per param. An optimizer class with a
    ``zero_grad`` of its own keeps the casts on in it, as in Apex."""
    rec = getattr(optimizer, "_amp_stash", None)
    inner = getattr(rec, "_orig_zero_grad", None)
    if (getattr(inner, "__func__", None) is not torch.optim.Optimizer.zero_grad
            or getattr(inner, "__self__", None) is not optimizer):
        return

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        m = _CURRENT
        if m is None:
            return torch.optim.Optimizer.zero_grad(self, set_to_none)
        with m.casts(False):
            return torch.optim.Optimizer.zero_grad(self, set_to_none)

    rec._orig_zero_grad = types.MethodType(zero_grad, optimizer)


def activate(owner: Any, low: torch.dtype, device_type: str, optimizers: list[Any],
             verbose: bool = False) -> O1Mode:
    """Install (or update) the O1 mode of ``owner`` (an ``Amp``) for an O1/O4 initialize.

    Args:
        owner: the object the mode belongs to; another owner's mode is replaced.
        low: float16 (O1) or bfloat16 (O4).
        device_type: the model's device type (the tensors that get cast).
        optimizers: their ``step`` runs with the casts off.
        verbose: print every cast.

    Returns:
        The installed mode (the owner's registrations are the caller's to apply:
        :func:`adapters.apex.amp._functions.apply_registry`).

    Example:
        >>> class Owner: pass
        >>> m = activate(Owner(), torch.bfloat16, "cpu", [])
        >>> (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> uninstall()
    """
    m = _CURRENT
    if m is None or getattr(m, "owner", None) is not owner:
        m = O1Mode(low, device_type, verbose=verbose)
        m.owner = owner
        install(m)
    m.low, m.device_type, m.verbose = low, device_type, verbose
    m.clear_cache()
    for o in optimizers:
        _no_casts_in_step(o)
    return m


def follow(owner: Any, props: Any, device_type: str, optimizers: list[Any],
           verbose: bool = False) -> O1Mode | None:
    """Make the casts follow an ``initialize`` of ``owner``: the latest one decides.

    At O1/O4 (``props.patch_torch_functions``) the mode is installed (see
    :func:`activate`); at any other level an installed mode is removed, with a warning.

    Args:
        owner: the ``Amp``.
        props: its resolved ``Properties``.
        device_type: the model's device type.
        optimizers: the optimizers of this initialize.
        verbose: print every cast.

    Returns:
        The installed mode, or None.

    Example:
        >>> from adapters.apex.amp._opt_levels import resolve_properties
        >>> follow(object(), resolve_properties("O2"), "cpu", []) is None
        True
    """
    if props.patch_torch_functions:
        return activate(owner, props.autocast_dtype, device_type, optimizers, verbose)
    if _CURRENT is not None:
        from adapters.apex.amp._log import LOGGER

        LOGGER.warning("amp.initialize(opt_level=%s) removes the O1 casts that an earlier "
                       "initialize installed: one set of casts per thread, the latest "
                       "initialize decides (models initialized at O1 before now run "
                       "uncast)", props.opt_level)
        uninstall()
    return None


@contextlib.contextmanager
def no_casts(device_type: str) -> Iterator[None]:
    """The O1 casts and ``torch.autocast`` of ``device_type`` off inside."""
    m = _CURRENT
    with (m.casts(False) if m is not None else contextlib.nullcontext()), \
            torch.autocast(device_type, enabled=False):
        yield


def casts_on() -> contextlib.AbstractContextManager[Any]:
    """The O1 casts on inside (a no-op context when no mode is installed)."""
    m = _CURRENT
    return m.casts(True) if m is not None else contextlib.nullcontext()


def active_low_dtype() -> torch.dtype | None:
    """The low dtype of the installed mode while its casts are on, else None."""
    m = _CURRENT
    return m.low if m is not None and m.active else None
