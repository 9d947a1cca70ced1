"""The helpers of ``apex.fp16_utils.fp16util``: half networks, master params, grads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

clip_grad_norm = nn.utils.clip_grad_norm_


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a number, or a sequence) as a Python number.

    Example:
        >>> to_python_float(torch.tensor([2.5])), to_python_float(3.0)
        (2.5, 3.0)
    """
    if hasattr(t, "item"):
        return t.item()
    if isinstance(t, (int, float)):
        return t
    return t[0]


class tofp16(nn.Module):
    """A module that casts its input to float16.

    Example:
        >>> tofp16()(torch.ones(1)).dtype
        torch.float16
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def _is_affine_bn(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and bool(m.affine)


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Turn the affine batch norms of ``module`` (in place) back to float32.

    Example:
        >>> net = BN_convert_float(torch.nn.Sequential(torch.nn.BatchNorm1d(2)).half())
        >>> net[0].weight.dtype
        torch.float32
    """
    if _is_affine_bn(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in float16 except its affine batch norms, behind an input cast.

    Returns:
        ``nn.Sequential(tofp16(), network)``, the network converted in place.

    Example:
        >>> net = network_to_half(torch.nn.Linear(2, 1))
        >>> net[1].weight.dtype, isinstance(net[0], tofp16)
        (torch.float16, True)
    """
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating params and buffers owned by ``module`` itself (not its children).

    Example:
        >>> lin = torch.nn.Linear(2, 1); convert_module(lin, torch.float16); lin.bias.dtype
        torch.float16
    """
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` except affine batch norms.

    Example:
        >>> net = convert_network(torch.nn.Sequential(torch.nn.Linear(2, 2),
        ...                       torch.nn.BatchNorm1d(2)), torch.float16)
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.float16, torch.float32)
    """
    for module in network.modules():
        if _is_affine_bn(module):
            continue
        convert_module(module, dtype)
    return network


class FP16Model(nn.Module):
    """``network`` converted to float16 (batch norms kept), casting its inputs to float16.

    Example:
        >>> m = FP16Model(torch.nn.Linear(2, 1))
        >>> m(torch.ones(1, 2)).dtype
        torch.float16
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False
                     ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trainable params of ``model`` and float32 master copies of them.

    Args:
        model: the (float16) model.
        flat_master: one flat float32 master param for all (they must share a dtype).

    Returns:
        ``(model_params, master_params)``.

    Raises:
        TypeError: ``flat_master`` with params of several dtypes.

    Example:
        >>> model_p, master_p = prep_param_lists(torch.nn.Linear(2, 1).half())
        >>> [p.dtype for p in master_p]
        [torch.float32, torch.float32]
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(f"prep_param_lists(flat_master=True) needs params of one dtype, "
                            f"got {sorted(map(str, dtypes))}")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(flat)
        return model_params, [master]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: Iterable[torch.Tensor],
                                master_params: list[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model's grads into the master params' grads (float32).

    Example:
        >>> model_p, master_p = prep_param_lists(torch.nn.Linear(2, 1))
        >>> for p in model_p: p.grad = torch.ones_like(p)
        >>> model_grads_to_master_grads(model_p, master_p); master_p[0].grad.tolist()
        [[1.0, 1.0]]
    """
    model_params = list(model_params)
    if flat_master:
        master_params[0].grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


@torch.no_grad()
def master_params_to_model_params(model_params: Iterable[torch.Tensor],
                                  master_params: list[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the master params' values into the model's params (cast to their dtype).

    Example:
        >>> model_p, master_p = prep_param_lists(torch.nn.Linear(2, 1).half())
        >>> with torch.no_grad(): _ = master_p[1].fill_(0.5)
        >>> master_params_to_model_params(model_p, master_p); model_p[1].item()
        0.5
    """
    model_params = list(model_params)
    if flat_master:
        news = _unflatten_dense_tensors(master_params[0].detach(), model_params)
        for model, new in zip(model_params, news, strict=True):
            model.copy_(new)
        return
    for model, master in zip(model_params, master_params, strict=True):
        model.copy_(master)
