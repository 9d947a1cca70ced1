"""Checks of the hyper-parameters given to the transformations (a clear error, never a guess)."""

from __future__ import annotations

import math
import numbers

import torch

from fmp.dtypes import dtype as _dtype


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_range(
    fn: str, name: str, value: object, *, upper: float | None = None, accepted: str
) -> float:
    """``value`` as a float when it is a finite real number in [0, upper) (or [0, inf)),
    else raise (inf and NaN are never accepted: they would put inf / NaN into the params)."""
    ok = (_is_real(value) and math.isfinite(value)  # type: ignore[arg-type]
          and value >= 0.0 and (upper is None or value < upper))  # type: ignore[operator]
    if not ok:
        raise ValueError(f"{fn}: invalid {name} {value!r}; accepted: {accepted}")
    return float(value)  # type: ignore[arg-type]


def _check_betas(fn: str, betas: object) -> tuple[float, float]:
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(
            f"{fn}: invalid betas {betas!r}; accepted: a pair (beta1, beta2) of floats in [0, 1)"
        )
    return tuple(  # type: ignore[return-value]
        _check_range(fn, f"beta parameter at index {i}", b, upper=1.0,
                     accepted="a finite float in [0, 1)")
        for i, b in enumerate(betas)
    )


def _check_amsgrad(fn: str, amsgrad: object) -> bool:
    if not isinstance(amsgrad, bool):
        raise ValueError(f"{fn}: invalid amsgrad {amsgrad!r}; accepted: True or False")
    return amsgrad


def _state_dtype(fn: str, state_dtype: object) -> torch.dtype | None:
    if state_dtype is None:
        return None
    try:
        return _dtype(state_dtype)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{fn}: invalid state_dtype: {e}") from None


def _check_momentum(
    fn: str, momentum: object, dampening: object, nesterov: object, state_dtype: object
) -> tuple[float, float, torch.dtype | None]:
    m = _check_range(fn, "momentum", momentum, accepted="a finite float >= 0")
    if not _is_real(dampening) or not math.isfinite(dampening):  # type: ignore[arg-type]
        raise ValueError(f"{fn}: invalid dampening {dampening!r}; accepted: a finite float")
    d = float(dampening)  # type: ignore[arg-type]
    if not isinstance(nesterov, bool):
        raise ValueError(f"{fn}: invalid nesterov {nesterov!r}; accepted: True or False")
    if nesterov and (m <= 0.0 or d != 0.0):
        raise ValueError(
            f"{fn}: Nesterov momentum requires a momentum > 0 and zero dampening; got "
            f"momentum={m}, dampening={d}"
        )
    return m, d, _state_dtype(fn, state_dtype)
