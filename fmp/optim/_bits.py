"""Rounding float32 to bfloat16 stochastically, with random bits from a counter-based hash.

The random bits are a pure function of a key tensor, a leaf number and the element's index
(no global RNG, no ``torch.Generator``): the same key gives the same rounding on any device,
a key carried in the optimizer state makes a resumed run bit-identical, and nothing syncs the
host. The hash works on int64 tensors holding 32-bit values; every product stays below
2**63 (multipliers < 2**31), so no integer op overflows.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # odd multipliers below 2**31: bijections of the 32-bit integers
_C2 = 0x2C1B3C6D
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def leaf_seed(key: torch.Tensor, leaf: int) -> torch.Tensor:
    """A 0-d int64 seed in [0, 2**32) for leaf number ``leaf`` under ``key`` (0-d int64)."""
    lo, hi = key & _M32, (key >> 32) & _M32
    return _mix32(lo ^ _mix32(hi ^ ((leaf * _GOLDEN + 1) & _M32)))


def random16(seed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Uniform random integers in [0, 2**16) (int32) of ``shape``, a function of ``seed``."""
    n = 1
    for s in shape:
        n *= s
    j = torch.arange(n, dtype=torch.int64, device=seed.device)
    r = _mix32(_mix32(j ^ seed) ^ (seed >> 5))
    return (r >> 16).to(torch.int32).reshape(shape)


def stochastic_round_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 up or down at random, unbiased in expectation.

    The 16 bits bfloat16 drops are replaced by their sum with ``r16`` (uniform in
    [0, 2**16)) and then cut off: ``x`` rounds away from zero with probability equal to its
    distance from the lower neighbour over the spacing. Infinities stay, NaN stays NaN.
    """
    bits = x.view(torch.int32)
    out = ((bits + r16) & -65536).view(torch.float32)  # -65536: 0xFFFF0000
    return torch.where(torch.isnan(x), x, out).to(torch.bfloat16)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest bfloat16 (ties to even), kept in float32.

    Equal to ``x.to(torch.bfloat16).to(torch.float32)``, but written with integer ops:
    inductor (``emulate_precision_casts=False``, its default) may drop that cast pair
    inside a fused kernel, which would silently turn the Kahan compensation off.
    """
    bits = x.view(torch.int32)
    bias = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + bias) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)
