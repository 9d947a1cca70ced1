"""Validation of a loss-scale record's values (Python numbers; never on the adjust path).

Called only by the records' constructors, ``create`` and ``from_state_dict``; the arithmetic
(``scale``, ``unscale``, ``adjust``) and the pytree unflattening never validate.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any

import torch

INT32_MAX = 2**31 - 1


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (inf where it is out of float32 range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def real(value: Any, name: str) -> float:
    """``value`` as a Python float; ValueError unless it is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def positive_f32(value: Any, name: str) -> float:
    """A Python real that is finite and positive, also once rounded to float32."""
    x = real(value, name)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if f32(x) == 0.0 or not math.isfinite(f32(x)):
        raise ValueError(
            f"{name} must be representable as a positive finite float32 "
            f"(about 1.4e-45 to 3.4e38), got {value!r}"
        )
    return x


def int_in(value: Any, name: str, low: int, high: int = INT32_MAX) -> int:
    """A Python integer (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    v = int(value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return v


def check_hyper_parameters(
    period: Any, factor: Any, min_scale: Any, max_scale: Any, hysteresis: Any
) -> tuple[int, float, float, float, int]:
    """Validate and normalise the hyper-parameters of a :class:`DynamicLossScale`."""
    period = int_in(period, "period", 1)
    factor_f = real(factor, "factor")
    if not math.isfinite(factor_f) or factor_f <= 1.0:
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    min_f = positive_f32(min_scale, "min_scale")
    max_f = positive_f32(max_scale, "max_scale")
    if f32(min_f) > f32(max_f):
        raise ValueError(
            f"min_scale must be <= max_scale, got min_scale={min_scale!r} > "
            f"max_scale={max_scale!r}"
        )
    hysteresis = int_in(hysteresis, "hysteresis", 1)
    return period, factor_f, min_f, max_f, hysteresis


def check_in_bounds(scale: float, min_scale: float, max_scale: float, what: str) -> None:
    """ValueError unless ``scale`` lies in ``[min_scale, max_scale]`` (as float32 values)."""
    if not f32(min_scale) <= f32(scale) <= f32(max_scale):
        raise ValueError(
            f"{what} must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
            f"got {scale!r}; change the bounds or the scale (it is not clamped)"
        )


def is_concrete(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value is free: a plain CPU tensor outside any tracing.

    Values of device tensors are not read at construction (that would synchronise the
    host), nor of tensors being traced by torch.compile or wrapped by torch.func.
    """
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def scalar_tensor(
    value: Any, dtype: torch.dtype, name: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """``value`` (a Python number or a one-element tensor) as a 0-d tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a 0-d (one-element) tensor, got shape {tuple(value.shape)}"
            )
        wanted = "real" if dtype.is_floating_point else "integer"
        if (value.is_complex() or value.dtype == torch.bool
                or (value.is_floating_point() and not dtype.is_floating_point)):
            raise ValueError(f"{name} must be a one-element {wanted} tensor, got dtype "
                             f"{value.dtype}")
        t = value.detach().reshape(()).to(dtype)
        return t if device is None else t.to(device)
    return torch.tensor(value, dtype=dtype, device=device)


def as_finite_flag(grads_finite: Any, device: torch.device) -> torch.Tensor:
    """The ``grads_finite`` argument of ``adjust`` as a 0-d bool tensor."""
    if isinstance(grads_finite, bool):
        return torch.tensor(grads_finite, device=device)
    if not isinstance(grads_finite, torch.Tensor):
        raise ValueError(
            f"adjust needs a 0-d bool tensor (e.g. fmp.all_finite(grads)), got "
            f"{type(grads_finite).__name__}"
        )
    if grads_finite.dtype != torch.bool or grads_finite.dim() != 0:
        raise ValueError(
            f"adjust needs a 0-d bool tensor (e.g. fmp.all_finite(grads)), got a tensor of "
            f"dtype {grads_finite.dtype} and shape {tuple(grads_finite.shape)}"
        )
    return grads_finite


def check_state_dict(d: Any, cls_name: str, keys: tuple[str, ...]) -> None:
    """ValueError unless ``d`` is a mapping with exactly ``keys`` and ``type == cls_name``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls_name}.from_state_dict needs a dict, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    unknown = [k for k in d if k not in keys]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unknown:
            parts.append(f"unknown keys {unknown}")
        raise ValueError(
            f"{cls_name}.from_state_dict: {' and '.join(parts)}; expected exactly "
            f"{list(keys)}"
        )
    if d["type"] != cls_name:
        raise ValueError(
            f"{cls_name}.from_state_dict: the state dict is of type {d['type']!r}, "
            f"not {cls_name!r} (fmp.loss_scale_from_state_dict dispatches on it)"
        )


def number(value: Any, name: str) -> Any:
    """A state-dict value as a Python number (a one-element tensor is read, on the host)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return value.item()
    return value
