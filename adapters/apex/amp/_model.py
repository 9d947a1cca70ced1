"""The model side of initialize: casting (O2/O3/O5), the wrapped forward, float32 state dicts.

No global patching: the model's ``forward`` is replaced on the *instance* by a
:class:`WrappedForward`, which casts floating inputs to the compute dtype, runs the
original forward (under ``torch.autocast`` at O1/O4), and casts floating outputs. The
dtypes are an :class:`fmp.Policy`; the casts are :func:`fmp.cast_tree`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

import fmp
from adapters.apex.amp._nested import cast_nested


def model_device_type(model: torch.nn.Module) -> str:
    """The device type of the model's first parameter (or buffer); CPU for an empty model.

    Example:
        >>> model_device_type(torch.nn.Linear(2, 2))
        'cpu'
    """
    for t in model.parameters():
        return t.device.type
    for t in model.buffers():
        return t.device.type
    return "cpu"


def cast_model(model: torch.nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast the model's floating params and buffers to ``dtype``, in place.

    Parameters keep their identity (their ``.data`` is swapped), so an optimizer built
    before initialize still holds them. The per-parameter dtypes come from
    :func:`fmp.module_policies`, batch-norm layers mapped to float32 when
    ``keep_batchnorm_fp32``.

    Args:
        model: the module.
        dtype: the low dtype (float16 or bfloat16), or float32 (O0).
        keep_batchnorm_fp32: leave ``_BatchNorm`` layers (params and buffers) alone.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> cast_model(net, torch.float16, True)
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.float16, torch.float32)
    """
    low = fmp.Policy(dtype, dtype, dtype)
    overrides = {_BatchNorm: fmp.Policy()} if keep_batchnorm_fp32 else {}
    policies = fmp.module_policies(model, low, overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            target = policies[name].param_dtype
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
        for module in model.modules():
            if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
                continue
            for key, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[key] = b.to(dtype)


def _to_fp32_hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    for key, value in state_dict.items():
        if (key.startswith(prefix) and isinstance(value, torch.Tensor)
                and value.is_floating_point() and value.dtype != torch.float32):
            state_dict[key] = value.detach().to(torch.float32)


def register_fp32_state_dict(model: torch.nn.Module) -> None:
    """Make ``model.state_dict()`` return float32 tensors (Apex's O2/O3 behaviour).

    Example:
        >>> net = torch.nn.Linear(2, 2).half()
        >>> register_fp32_state_dict(net)
        >>> net.state_dict()["weight"].dtype
        torch.float32
    """
    model.register_state_dict_post_hook(_to_fp32_hook)


class WrappedForward:
    """A replacement for ``module.forward``: input casts, autocast, output casts.

    It holds the module (so ``copy.deepcopy`` of the model rewires it to the copy) and
    calls the class's forward, or the instance forward that was there before.

    Args:
        module: the model.
        inner: a forward set on the instance before initialize, or None.
        policy: compute dtype for floating inputs and output dtype for outputs.
        cast_inputs: cast floating inputs to ``policy.compute_dtype``.
        cast_outputs: cast floating outputs to ``policy.output_dtype``.
        autocast_dtype: run the forward under ``torch.autocast`` with this dtype, or None.

    Example:
        >>> net = torch.nn.Linear(2, 2).half()
        >>> net.forward = WrappedForward(net, None, fmp.get_policy("fp16-mixed"), True, True)
        >>> net(torch.ones(1, 2)).dtype
        torch.float32
    """

    def __init__(self, module: torch.nn.Module, inner: Any, policy: fmp.Policy,
                 cast_inputs: bool, cast_outputs: bool,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.inner = inner
        self.policy = policy
        self.cast_inputs = cast_inputs
        self.cast_outputs = cast_outputs
        self.autocast_dtype = autocast_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = self.policy.cast_to_compute((args, kwargs))
        fwd = self.inner if self.inner is not None else type(self.module).forward.__get__(
            self.module)
        ctx: Any = contextlib.nullcontext()
        if self.autocast_dtype is not None:
            ctx = torch.autocast(model_device_type(self.module), dtype=self.autocast_dtype)
        with ctx:
            out = fwd(*args, **kwargs)
        return cast_nested(out, self.policy.cast_to_output) if self.cast_outputs else out
