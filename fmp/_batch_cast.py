"""Which batch leaves a step casts to the compute dtype, and the check that a cast overflowed.

A mixed-precision step casts the floating leaves of the batch to the compute dtype. Targets
or inputs outside that dtype's range (a float16 regression target of 70000) become inf, the
loss is inf and every step is skipped: ``cast_batch`` leaves chosen positional arguments in
their own dtype, and the first eager call warns when the cast turned a finite value into an
inf (a check on the host, done once, so the steps after it stay free of host syncs).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fmp.tree import cast_tree

CastBatch = bool | Sequence[bool]


def check_cast_batch(cast_batch: Any) -> CastBatch:
    """``cast_batch`` as given, after checking it is a bool or a sequence of bools."""
    if isinstance(cast_batch, bool):
        return cast_batch
    if (isinstance(cast_batch, Sequence) and not isinstance(cast_batch, str)
            and all(isinstance(c, bool) for c in cast_batch)):
        return tuple(cast_batch)
    raise ValueError(f"cast_batch must be True, False or a sequence of bools (one per "
                     f"positional batch argument), got {cast_batch!r}")


def _mask(cast_batch: CastBatch, n: int) -> tuple[bool, ...]:
    if isinstance(cast_batch, bool):
        return (cast_batch,) * n
    if len(cast_batch) != n:
        raise ValueError(f"cast_batch has {len(cast_batch)} entries but the step got {n} "
                         f"positional batch arguments; give one bool per argument")
    return tuple(cast_batch)


def cast_batch_args(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                    cast_batch: CastBatch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast the floating leaves of the arguments ``cast_batch`` selects to ``dtype``;
    keyword arguments are cast unless ``cast_batch`` is False."""
    mask = _mask(cast_batch, len(args))
    cargs = tuple(cast_tree(a, dtype) if m else a for a, m in zip(args, mask, strict=True))
    ckwargs = kwargs if cast_batch is False else cast_tree(kwargs, dtype)
    return cargs, ckwargs


def _can_read(x: torch.Tensor) -> bool:
    """Whether reading a value of ``x`` on the host is allowed here (no sync-debug error)."""
    if x.device.type != "cuda":
        return x.device.type == "cpu"
    return torch.cuda.get_sync_debug_mode() == 0


def warn_cast_overflow(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                       cast_batch: CastBatch, where: str) -> None:
    """Warn (once per call) about every selected floating leaf that the cast to ``dtype``
    turns from finite into inf. Reads the values on the host: call it once, in eager mode."""
    if torch.compiler.is_compiling() or dtype not in (torch.float16, torch.bfloat16):
        return
    mask = _mask(cast_batch, len(args))
    chosen: dict[str, Any] = {f"arg {i}": a for i, (a, m) in enumerate(zip(args, mask,
                                                                          strict=True)) if m}
    if cast_batch is not False:
        chosen.update({f"keyword {k!r}": v for k, v in kwargs.items()})
    for name, tree in chosen.items():
        paths, leaves, _ = optree.tree_flatten_with_path(tree)
        for path, x in zip(paths, leaves, strict=True):
            if not (isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.dtype != dtype and x.numel() and _can_read(x)):
                continue
            with torch.no_grad():
                bad = torch.isfinite(x) & ~torch.isfinite(x.to(dtype))
                if not bool(bad.any()):
                    continue
                big = float(x[bad].abs().max())
            leaf = name + "".join(f"[{p!r}]" for p in path)
            warnings.warn(
                f"{where}: batch {leaf} ({x.dtype}) holds values up to {big:g}, which become "
                f"inf when cast to the compute dtype {dtype} (max "
                f"{torch.finfo(dtype).max:g}): the loss is not finite and such steps are "
                "skipped. Leave the argument in its dtype with cast_batch=(...) (one bool "
                "per positional batch argument), or rescale it.",
                RuntimeWarning, stacklevel=4)
