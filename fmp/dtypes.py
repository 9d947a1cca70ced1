"""Dtype names: one parser for every place that takes a dtype by name."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "dtype", "dtype_name", "is_floating"]

#: Accepted names (case-insensitive) and the dtype each one means.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "f32": torch.float32,
    "fp32": torch.float32,
    "full": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "f64": torch.float64,
    "fp64": torch.float64,
}

_CANONICAL: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def dtype(name_or_dtype: str | torch.dtype) -> torch.dtype:
    """Turn a dtype name into a floating ``torch.dtype``.

    Args:
        name_or_dtype: a name such as ``"bf16"``, ``"float16"`` or ``"full"``
            (case-insensitive, surrounding spaces ignored), or a floating ``torch.dtype``,
            which is returned as it is.

    Returns:
        The ``torch.dtype``.

    Raises:
        ValueError: the name is unknown, or the dtype is not one of float16, bfloat16,
            float32, float64. The message quotes the value and lists the accepted names.

    Example:
        >>> fmp.dtype("BF16")
        torch.bfloat16
    """
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype not in _CANONICAL:
            raise ValueError(
                f"unsupported dtype {name_or_dtype}; accepted: "
                f"{', '.join(str(d) for d in _CANONICAL)}, or the names "
                f"{', '.join(DTYPE_NAMES)}"
            )
        return name_or_dtype
    if isinstance(name_or_dtype, str):
        key = name_or_dtype.strip().lower()
        if key.startswith("torch."):
            key = key[len("torch.") :]
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    raise ValueError(
        f"unknown dtype {name_or_dtype!r}; accepted names: {', '.join(DTYPE_NAMES)} "
        "(case-insensitive), or a floating torch.dtype"
    )


def dtype_name(d: torch.dtype) -> str:
    """The canonical name of a floating dtype, e.g. ``"bfloat16"``.

    Args:
        d: a dtype accepted by :func:`dtype`.

    Returns:
        One of ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``.

    Raises:
        ValueError: ``d`` is not a supported floating dtype.

    Example:
        >>> fmp.dtypes.dtype_name(torch.float16)
        'float16'
    """
    return _CANONICAL[dtype(d)]


def is_floating(x: object) -> bool:
    """True when ``x`` is a floating-point tensor (the leaves that casts touch)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point()
