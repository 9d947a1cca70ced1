"""Turn an ``nn.Module`` into a pure function of a params dict (torch.func.functional_call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call

__all__ = ["functional"]

ApplyFn = Callable[..., Any]


def functional(model: torch.nn.Module) -> tuple[ApplyFn, dict[str, torch.Tensor],
                                                 dict[str, torch.Tensor]]:
    """Split a module into a pure apply function, its params and its buffers.

    ``apply_fn(params, *args, buffers=None, return_buffers=False, **kwargs)`` runs the
    module's forward with the given params (through ``torch.func.functional_call``, tied
    weights kept tied). Buffers:

    - ``buffers=None`` uses the module's own buffers, exactly as calling the module would
      (a BatchNorm in training mode updates them in place);
    - ``buffers=b`` uses ``b``; with ``return_buffers=True`` the call works on copies and
      returns ``(out, new_buffers)``, leaving ``b`` (and the module) untouched. This is the
      pure form the train step uses for model state.

    Args:
        model: any ``nn.Module``. Its train/eval mode is used as it is at call time.

    Returns:
        ``(apply_fn, params, buffers)``: ``params`` and ``buffers`` are dicts keyed by the
        module's names, holding detached tensors that share storage with the module's
        (no copy is made; the pure train step never writes into them).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> net = torch.nn.Linear(3, 2)
        >>> apply_fn, params, buffers = fmp.functional(net)
        >>> apply_fn(params, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fmp.functional needs a torch.nn.Module, got {type(model).__name__}")
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def apply_fn(params: dict[str, Any], *args: Any, buffers: dict[str, Any] | None = None,
                 return_buffers: bool = False, **kwargs: Any) -> Any:
        if buffers is None:
            buffers = {n: b for n, b in model.named_buffers()}
        if return_buffers:
            buffers = {n: (b.clone() if isinstance(b, torch.Tensor) else b)
                       for n, b in buffers.items()}
        out = functional_call(model, (params, buffers), args, kwargs, tie_weights=True,
                              strict=False)
        return (out, buffers) if return_buffers else out

    apply_fn.__doc__ = f"Pure forward of {type(model).__name__} (see fmp.functional)."
    return apply_fn, params, buffers
