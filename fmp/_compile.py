"""``fmp.compile``: torch.compile for a train step, with the workarounds fmp knows of."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile", "inductor_workarounds"]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def inductor_workarounds() -> dict[str, Any]:
    """Inductor settings fmp applies when it compiles a step on this torch version.

    torch 2.11's inductor raised an ``AssertionError`` in loop reordering on the whole
    GPT-2 train step on an H200 (benchmarks/NOTES.md); with that pass off the step compiles
    and runs at the same speed. It is turned off for torch older than 2.13, where the step
    was not seen to need it; 2.13 and newer get no change.

    Returns:
        A dict of ``torch._inductor.config`` names and values (empty when none apply).

    Example:
        >>> isinstance(fmp.inductor_workarounds(), dict)
        True
    """
    if _torch_version() < (2, 13):
        return {"loop_ordering_after_fusion": False}
    return {}


def compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, **kwargs)``, with :func:`inductor_workarounds`.

    The workarounds are applied around every call (compilation happens on the first calls
    and on recompiles), as a ``torch._inductor.config.patch``; they do not leak to other
    compiled code.

    Args:
        fn: the function to compile, typically a step from :func:`fmp.train_step`.
        **kwargs: passed to ``torch.compile`` (``fullgraph`` defaults to True here).

    Returns:
        The compiled function.

    Example:
        >>> step = fmp.compile(lambda x: x * 2, backend="eager")
        >>> float(step(torch.ones(())))
        2.0
    """
    kwargs.setdefault("fullgraph", True)
    compiled = torch.compile(fn, **kwargs)
    patch = inductor_workarounds()
    if not patch:
        return compiled

    @functools.wraps(fn)
    def run(*args: Any, **kw: Any) -> Any:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(patch):
            return compiled(*args, **kw)

    return run
