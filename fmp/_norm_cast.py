"""Norm layers whose params are kept in float32 while the activations are 16-bit.

The mixed presets keep norm layers' params in float32 (``fmp.policy.NORM_LAYERS``), so a
LayerNorm inside a float16 step gets a float16 input and float32 weights. CPU kernels take
that mix; the CUDA kernels of ``layer_norm`` and ``group_norm`` do not ("expected scalar
type Half but found Float"), so every transformer broke on the GPU. BatchNorm and
InstanceNorm take the mix on both devices (cuDNN's recipe, Apex's ``keep_batchnorm_fp32``)
and are left alone.

While :func:`fmp.functional`'s ``apply_fn`` runs, a LayerNorm, GroupNorm or RMSNorm whose
weight dtype differs from its input's computes in its weight's dtype (the input is cast,
as torch.autocast runs ``layer_norm`` in float32) and hands its output back in its input's
dtype, so the next layer sees the activations' dtype as before. Outside ``apply_fn`` the
hooks do nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: the norm layers whose kernels need one dtype on CUDA
CAST_NORMS: tuple[type, ...] = tuple(
    c for c in (getattr(torch.nn, n, None) for n in ("LayerNorm", "GroupNorm", "RMSNorm"))
    if isinstance(c, type))

_MARK = "_fmp_norm_cast_hooks"

#: how many ``apply_fn`` calls are running (the hooks act only inside one; apply_fn
#: counts itself in and out)
depth = [0]


def _pre(pending: list[Any], module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    if not depth[0]:
        return None
    w = getattr(module, "weight", None)
    x = args[0] if args else None
    if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_floating_point()
            and w.is_floating_point() and x.dtype != w.dtype):
        pending.append(x.dtype)
        return (x.to(w.dtype), *args[1:])
    pending.append(None)
    return None


def _post(pending: list[Any], module: torch.nn.Module, args: tuple[Any, ...],
          out: Any) -> Any:
    if not depth[0] or not pending:
        return None
    dtype = pending.pop()
    return out.to(dtype) if dtype is not None and isinstance(out, torch.Tensor) else None


def install(model: torch.nn.Module) -> None:
    """Hook every LayerNorm / GroupNorm / RMSNorm of ``model`` once (a copy of a hooked
    module keeps its hooks and its mark, so it is not hooked twice)."""
    for m in model.modules():
        if isinstance(m, CAST_NORMS) and not getattr(m, _MARK, False):
            pending: list[Any] = []
            m.register_forward_pre_hook(functools.partial(_pre, pending))
            m.register_forward_hook(functools.partial(_post, pending))
            setattr(m, _MARK, True)
