"""Scaled, saturating casts to float8 and the amaxes and scales they are computed from.

All tensor ops (no ``.item()``): they run on the device without a host sync, under
``torch.func`` transforms, ``torch.compile(fullgraph=True)`` and CUDA graphs.
"""

from __future__ import annotations

import torch

from fmp.float8._recipe import FORMATS


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x``, a 0-d float32 tensor (no gradient flows through it).

    Example:
        >>> amax(torch.tensor([1.0, -3.0]))
        tensor(3.)
    """
    return x.detach().abs().amax().to(torch.float32)


def scale_from(amax: torch.Tensor, fp8_max: float | torch.Tensor, margin: float,
               old: torch.Tensor) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` where that is finite and ``amax`` is finite and > 0;
    ``old`` elsewhere (a zero, inf or NaN amax keeps the old scale). Float32, elementwise.

    Example:
        >>> scale_from(torch.tensor([2.0, 0.0]), 448.0, 1, torch.ones(2))
        tensor([112.,   1.])
    """
    new = (fp8_max / amax) / (2.0 ** margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(new)
    return torch.where(ok, new, old)


def to_float8(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x * scale`` in float32, saturated to the format's finite range, cast to ``fmt``.

    Saturation: a value beyond ``fp8_max`` becomes ``+-fp8_max`` (e4m3fn has no inf; e5m2's
    would turn one large value into an inf product). NaN stays NaN.

    Args:
        x: any floating tensor.
        scale: a float32 tensor broadcastable to ``x`` (usually 0-d).
        fmt: ``"e4m3"`` or ``"e5m2"``.

    Returns:
        The float8 tensor (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).

    Example:
        >>> to_float8(torch.tensor([1000.0, 1.0]), torch.tensor(1.0), "e4m3").float()
        tensor([448.,   1.])
    """
    dtype = FORMATS[fmt]
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-top, top).to(dtype)
