"""This thread's torch function mode stack, and taking the O1 mode off it while its casts are off.

With its casts off (``optimizer.step()`` of an initialized optimizer, ``amp.disable_casts()``)
the O1 mode passes every call through unchanged, yet each torch call would still cost a
trip through its Python ``__torch_function__``. :func:`take_off` removes the mode from
this thread's stack for such a region and puts it back at the same place after, which
gives the same results (a mode that passes a call through is the same as no mode) at no
cost per call. Where the stack cannot be edited (a torch without the stack functions,
while ``torch.compile`` traces, the mode on another thread's stack) nothing is moved and
the mode's ``active`` flag alone turns the casts off, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_LOCAL = threading.local()


class _Record:
    """A mode taken off this thread's stack at ``index``; ``back`` while put back inside."""

    __slots__ = ("alive", "back", "index", "mode")

    def __init__(self, mode: Any, index: int) -> None:
        self.mode, self.index, self.alive, self.back = mode, index, True, False


def stack_ops() -> tuple[Any, Any, Any] | None:
    """torch's (length, pop, push) of the thread's torch function mode stack, or None."""
    c = torch._C
    ops = (getattr(c, "_len_torch_function_stack", None),
           getattr(c, "_pop_torch_function_stack", None),
           getattr(c, "_push_on_torch_function_stack", None))
    return ops if all(ops) else None  # type: ignore[return-value]


def _edit(edit: Callable[[list[Any]], None]) -> None:
    ops = stack_ops()
    assert ops is not None
    length, pop, push = ops
    stack = [pop() for _ in range(length())][::-1]  # bottom first
    edit(stack)
    for m in stack:
        push(m)


def rebuild(keep: Callable[[Any], bool], insert: Any = None) -> None:
    """Rebuild this thread's mode stack without the modes ``keep`` rejects, ``insert``
    placed at the bottom (above torch's DeviceContext, which must stay lowest)."""
    if stack_ops() is None:  # pragma: no cover - very old or very new torch: plain push
        if insert is not None:
            insert.__enter__()
        return

    def edit(stack: list[Any]) -> None:
        stack[:] = [m for m in stack if keep(m)]
        if insert is not None:
            from torch.utils._device import DeviceContext

            at = 1 if stack and isinstance(stack[0], DeviceContext) else 0
            stack.insert(at, insert)

    _edit(edit)


def _records() -> list[_Record]:
    recs = getattr(_LOCAL, "records", None)
    if recs is None:
        recs = _LOCAL.records = []
    return recs


def _put(mode: Any, index: int) -> None:
    _edit(lambda stack: stack.insert(min(index, len(stack)), mode))


def _remove(mode: Any) -> int:
    """Take ``mode`` off this thread's stack; its index, or -1 when it was not there."""
    found = [-1]

    def edit(stack: list[Any]) -> None:
        for k, m in enumerate(stack):
            if m is mode:
                found[0] = k
                del stack[k]
                return

    _edit(edit)
    return found[0]


def take_off(mode: Any) -> Callable[[], None] | None:
    """Take ``mode`` off this thread's stack; returns the function that puts it back.

    Returns:
        The undo, or None when nothing was moved (the mode not on this thread's stack,
        ``torch.compile`` tracing, no stack functions in this torch).
    """
    if stack_ops() is None or torch.compiler.is_compiling():
        return None
    index = _remove(mode)
    if index < 0:
        return None
    rec = _Record(mode, index)
    recs = _records()
    recs.append(rec)

    def undo() -> None:
        if rec.alive:  # not uninstalled meanwhile (see forget)
            rec.alive = False
            recs.remove(rec)
            if not rec.back:
                _put(mode, rec.index)

    return undo


def put_back(mode: Any) -> Callable[[], None] | None:
    """Inside a :func:`take_off` region of ``mode``: put it back; returns the undo, or None."""
    if torch.compiler.is_compiling():
        return None
    rec = next((r for r in reversed(_records()) if r.mode is mode and not r.back), None)
    if rec is None:
        return None
    rec.back = True
    _put(mode, rec.index)

    def undo() -> None:
        if rec.alive and rec.back:
            rec.back = False
            _remove(mode)

    return undo


def forget(mode: Any) -> None:
    """Drop this thread's records of ``mode`` (it is being uninstalled: never put back)."""
    recs = _records()
    for r in [r for r in recs if r.mode is mode]:
        r.alive = False
        recs.remove(r)
