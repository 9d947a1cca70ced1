"""The in-place one-pass unscale and check: torch's amp kernel, and where it cannot run.

``torch._amp_foreach_non_finite_check_and_unscale_`` multiplies grads in place by a float32
reciprocal (in float32 arithmetic) and raises a ``found_inf`` flag on inf/NaN in the same
pass. :func:`fused_ok` is the one rule of which grads it takes; the two users are

- :func:`check_and_unscale_owned_`, the train step's pass over grads it owns: all or
  nothing (one device, every dtype taken; else the caller keeps its pure path);
- :func:`unscale_and_check_`, ``torch.amp.GradScaler.unscale_``'s contract on the
  caller's own tensors: per (device, dtype) group, and where the kernel does not take a
  group, a multiply in place and a separate read-only check.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fmp.tree import all_finite

# dtypes the step's own pass takes (float64 grads keep the step's pure path)
_OWNED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` takes these grads.

    It takes float16/float32/float64 everywhere and bfloat16 everywhere but on CUDA
    (there it rejects bfloat16, pytorch issue 127176): the one bf16-on-CUDA carve-out.

    Example:
        >>> fused_ok(torch.device("cpu"), torch.bfloat16)
        True
    """
    return dtype != torch.bfloat16 or device.type != "cuda"


def _dense(t: torch.Tensor) -> bool:
    """Contiguous in the default or a channels-last layout: no gaps, no overlaps."""
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


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
    if owned_already:
        if any(g.device != dev or g.dtype not in _OWNED_DTYPES or not fused_ok(dev, g.dtype)
               for g in grads):
            return None
    else:
        seen: set[int] = set()
        for g in grads:
            if (g.device != dev or g.dtype not in _OWNED_DTYPES
                    or not fused_ok(dev, g.dtype) or g._base is not None or not _dense(g)):
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

    Returns:
        The list of grads to write, the given tensors where they may be written.

    Example:
        >>> w = torch.ones(2)
        >>> owned([w], others=[w])[0] is w
        False
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


def unscale_and_check_(
    grads: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """Multiply ``grads`` in place by ``inv_scale`` and raise ``found_inf`` to 1 on inf/NaN.

    One ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group
    where the fused op takes the dtype; elsewhere (bfloat16 on CUDA) ``torch._foreach_mul_``
    followed by :func:`fmp.all_finite`. No host synchronisation.

    Args:
        grads: dense floating gradient tensors (modified in place).
        inv_scale: a 0-d float32 tensor, ``1 / loss_scale``.
        found_inf: a 0-d float32 tensor, 0.0 or 1.0; set to 1.0 when any grad is
            non-finite (it is never reset here).

    Example:
        >>> g = [torch.tensor([2.0, float("inf")])]
        >>> found = torch.zeros(())
        >>> unscale_and_check_(g, torch.tensor(0.5), found)
        >>> found
        tensor(1.)
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for (device, dtype), group in groups.items():
        if device not in per_device:
            if device == found_inf.device:
                per_device[device] = (inv_scale.to(device), found_inf)
            else:
                per_device[device] = (inv_scale.to(device), torch.zeros_like(found_inf,
                                                                              device=device))
        inv, found = per_device[device]
        if fused_ok(device, dtype):
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        else:
            torch._foreach_mul_(group, inv)
            found.copy_(torch.maximum(found, (~all_finite(group)).to(found.dtype)))
    for device, (_, found) in per_device.items():
        if device != found_inf.device:
            found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device)))
