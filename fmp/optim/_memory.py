"""How many bytes of persistent training state one parameter costs."""

from __future__ import annotations

from typing import Any

import optree
import torch


def state_bytes_per_param(params: Any, opt_state: Any = None, *, grads: bool = False) -> float:
    """Bytes of the params and the optimizer state per parameter element.

    Counts every tensor of ``params`` and ``opt_state`` (moments, compensation buffers,
    counters and keys), divided by the number of elements of the floating params;
    ``grads=True`` adds one grad per param in the param's dtype. Activations are not
    counted. bfloat16 params with a bf16 Kahan buffer and bf16 Adam moments cost 8 bytes
    (10 with grads); float32 masters with float32 moments 12 (16 with grads).

    Args:
        params: the params tree.
        opt_state: the optimizer state (``optimizer.init(params)``), or None.
        grads: also count the grads (one per param, in the param's dtype).

    Returns:
        The bytes per param element (0.0 for a tree without floating params).

    Example:
        >>> p = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
        >>> opt = fmp.optim.adamw(state_dtype="bf16", bf16_update="kahan")
        >>> round(fmp.optim.state_bytes_per_param(p, opt.init(p)), 2)
        8.0
    """
    leaves = [x for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor)]
    n = sum(x.numel() for x in leaves if x.is_floating_point())
    if n == 0:
        return 0.0
    held = leaves + [x for x in optree.tree_leaves(opt_state) if isinstance(x, torch.Tensor)]
    total = sum(x.numel() * x.element_size() for x in held)
    if grads:
        total += sum(x.numel() * x.element_size() for x in leaves if x.is_floating_point())
    return total / n
