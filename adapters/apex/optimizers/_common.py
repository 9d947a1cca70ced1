"""What the fused optimizers share: the kernel choice, Apex's ``set_grad_none``, and
loading a checkpoint saved by Apex's optimizers (one ``step`` per group)."""

from __future__ import annotations

import copy
from typing import Any

import torch


def materialize(params: Any) -> list[Any]:
    """``params`` as a list (a generator is read once), as torch optimizers accept it."""
    return list(params)


def param_list(params: list[Any]) -> list[torch.Tensor]:
    """Every tensor in ``params`` (tensors, or param-group dicts, or (name, tensor) pairs)."""
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):
            out.extend(param_list(list(p["params"])) if not isinstance(p["params"],
                                                                       torch.Tensor)
                       else [p["params"]])
        elif isinstance(p, tuple):
            out.append(p[1])
        else:
            out.append(p)
    return out


def kernel_kwargs(params: list[Any]) -> dict[str, bool]:
    """``{"fused": True}`` when every param is a CUDA float tensor, else ``{"foreach": True}``.

    Example:
        >>> kernel_kwargs([torch.zeros(1)])
        {'foreach': True}
    """
    ts = param_list(params)
    if ts and all(t.device.type == "cuda" and t.is_floating_point() for t in ts):
        return {"fused": True}
    return {"foreach": True}


def per_param_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An Apex optimizer checkpoint with its per-group ``step`` copied into every param's
    state, as torch.optim keeps it; a torch checkpoint is returned unchanged.

    Example:
        >>> sd = {"state": {0: {"exp_avg": torch.zeros(1)}},
        ...       "param_groups": [{"params": [0], "step": 3}]}
        >>> per_param_steps(sd)["state"][0]["step"]
        tensor(3.)
    """
    groups = state_dict.get("param_groups", [])
    if not any("step" in g for g in groups):
        return state_dict
    sd = copy.copy(state_dict)
    sd["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
    sd["param_groups"] = []
    for g in groups:
        g = dict(g)
        step = g.pop("step", None)
        for i in g["params"]:
            st = sd["state"].get(i)
            if st is not None and "step" not in st and step is not None:
                st["step"] = torch.tensor(float(step))
        sd["param_groups"].append(g)
    return sd
