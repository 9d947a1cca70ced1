"""In-place unscale for the donated train step: one pass that unscales and checks the grads.

(The fused in-place optimizer kernels live in ``fmp.optim``: :func:`fmp.optim.update_in_place`.)
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = [
    "check_and_unscale_owned_",
    "eager_kernels_ok",
    "owned",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dense(t: torch.Tensor) -> bool:
    """Contiguous in the default or a channels-last layout: no gaps, no overlaps."""
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def eager_kernels_ok() -> bool:
    """True in plain eager mode: not being compiled, not inside a torch.func transform."""
    return (not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is None)


def check_and_unscale_owned_(grads: list[torch.Tensor], inv_scale: torch.Tensor,
                             owned_already: bool = False) -> torch.Tensor | None:
    """Unscale grads in place and check them in one pass (torch's amp kernel), if safe.

    Safe means the step owns every tensor: each is dense (contiguous, or channels-last
    contiguous), no view of another tensor, and no two share storage (autograd can hand
    one grad to two params, or an expanded one). float32/float16 (and bfloat16 on CPU:
    the CUDA kernel rejects it) on one device.

    Args:
        grads: the grad tensors, fresh from autograd or from the accumulation sum.
        inv_scale: 0-d float32 tensor the grads are multiplied by.
        owned_already: the grads come from :func:`owned`, so only their devices and
            dtypes are checked (the per-tensor storage checks cost host time that the
            eager step would otherwise pay twice).

    Returns:
        The finite verdict (0-d bool tensor), or None when not safe (nothing touched).

    Example:
        >>> g = [torch.tensor([4.0, 8.0])]
        >>> check_and_unscale_owned_(g, torch.tensor(0.25)).item(), g[0].tolist()
        (True, [1.0, 2.0])
    """
    if not grads:
        return None
    dev = grads[0].device
    ok = (torch.float32, torch.float16) if dev.type == "cuda" else _DTYPES
    if owned_already:
        if any(g.dtype not in ok or g.device != dev for g in grads):
            return None
    else:
        seen: set[int] = set()
        for g in grads:
            if (g.device != dev or g.dtype not in ok or g._base is not None
                    or not _dense(g)):
                return None
            ptr = g.untyped_storage().data_ptr()
            if ptr in seen:
                return None
            seen.add(ptr)
    found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                     inv_scale.reshape(1).to(torch.float32))
    return found_inf[0] == 0


def owned(grads: list[torch.Tensor], others: Any = None) -> list[torch.Tensor]:
    """The grads, with a private copy of any the step does not own alone.

    The in-place kernels write the unscaled grads back. autograd may return one tensor for
    two params (both inputs of an add), an expanded tensor, a view, or (from a custom
    autograd Function) a tensor the caller holds: those are cloned (rare and small), so
    that every grad is written exactly once and nothing of the caller's is written.

    Args:
        grads: the grad tensors.
        others: a pytree of the caller's tensors (params, batch, state) that no grad may
            share storage with.
    """
    seen: set[int] = {x.untyped_storage().data_ptr() for x in optree.tree_leaves(others)
                      if isinstance(x, torch.Tensor)}
    out = []
    for g in grads:
        ptr = g.untyped_storage().data_ptr()
        if g._base is not None or not _dense(g) or ptr in seen:
            g = g.clone(memory_format=torch.contiguous_format)
            ptr = g.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(g)
    return out
