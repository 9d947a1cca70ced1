"""Unscale gradients and check them for inf/NaN in one fused pass, grouped by device and dtype."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

import fmp

__all__ = ["fused_ok", "unscale_and_check_"]


def fused_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._amp_foreach_non_finite_check_and_unscale_`` takes these grads.

    It takes float16/float32/float64 everywhere; bfloat16 only on the CPU (on CUDA it
    rejects bfloat16, pytorch issue 127176).

    Example:
        >>> fused_ok(torch.device("cpu"), torch.bfloat16)
        True
    """
    return dtype != torch.bfloat16 or device.type == "cpu"


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
            found.copy_(torch.maximum(found, (~fmp.all_finite(group)).to(found.dtype)))
    for device, (_, found) in per_device.items():
        if device != found_inf.device:
            found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device)))
