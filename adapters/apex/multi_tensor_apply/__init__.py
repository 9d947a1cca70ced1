"""``apex.multi_tensor_apply``: the launcher of the :mod:`adapters.apex.amp_C` kernels.

``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls
``op(chunk_size, noop_flag, tensor_lists, *args)``, as Apex's did. The kernels are
torch ops here, so ``available`` is always True, on CPU too.

Example:
    >>> from adapters.apex import amp_C
    >>> from adapters.apex.multi_tensor_apply import multi_tensor_applier
    >>> flag = torch.zeros(1, dtype=torch.int)
    >>> norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag,
    ...                                [[torch.tensor([3.0, 4.0])]], False)
    >>> norm.item(), int(flag)
    (5.0, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls a multi-tensor kernel with a fixed ``chunk_size`` (Apex's: 2048 * 32).

    Args:
        chunk_size: passed to every kernel as its first argument (unused by ours).

    Example:
        >>> MultiTensorApply(65536).available
        True
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raised here without its CUDA extension; the torch kernels always exist."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: Any, tensor_lists: Any,
                 *args: Any) -> Any:
        """Run ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``; return its result."""
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
