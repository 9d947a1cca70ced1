"""In-place fused optimizer kernels for the donated train step.

``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` update params and moments in
one multi-tensor kernel, divide the grads by ``grad_scale`` on the way and do nothing when
``found_inf`` is 1: unscale, update and skip in a single pass, with no host sync. They are
the kernels behind ``torch.optim.Adam(fused=True)``. fmp uses them only where they compute
exactly its own formulas (otherwise the step falls back to the pure foreach path):

- every param, grad and moment on one device and of one dtype (float32, float16 or
  bfloat16), a CUDA or CPU device;
- SGD without dampening (the fused kernel's first step differs with dampening).

An in-place update is what ``donate=True`` asks for: the params and moments passed in are
overwritten (or left bit-identical on a skipped step).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = [
    "FusedSpec",
    "eager_kernels_ok",
    "fused_step_",
    "fused_supported",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedSpec:
    """What an optimizer tells the step so it can run the fused kernel (its hyper-parameters)."""

    def __init__(self, kind: str, **hp: Any) -> None:
        self.kind = kind
        self.hp = hp


def _same_layouts(p: list[torch.Tensor], others: list[list[torch.Tensor]]) -> bool:
    """The fused kernels need each grad and moment shaped and laid out exactly as its param
    (a mismatch goes to the pure path, which names the leaf)."""
    return all(len(o) == 0 or all(a.shape == b.shape and a.stride() == b.stride()
                                  for a, b in zip(p, o, strict=True))
               for o in others)


def _uniform(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return False
    d, dev = tensors[0].dtype, tensors[0].device
    return d in _DTYPES and dev.type in ("cuda", "cpu") and all(
        t.dtype == d and t.device == dev for t in tensors)


def _lists(spec: FusedSpec, params: Any, grads: Any, state: Any
           ) -> tuple[list[Any], list[Any], list[list[Any]]] | None:
    p, tree = optree.tree_flatten(params)
    try:
        g = tree.flatten_up_to(grads)
        if spec.kind in ("adam", "adamw"):
            moments = [tree.flatten_up_to(state.mu), tree.flatten_up_to(state.nu),
                       tree.flatten_up_to(state.nu_max) if spec.hp["amsgrad"] else []]
        elif spec.kind == "sgd" and spec.hp["dampening"] == 0.0:
            moments = [tree.flatten_up_to(state.momentum) if spec.hp["momentum"] != 0.0
                       else []]
        else:
            return None
    except (ValueError, TypeError, AttributeError):
        return None
    if not _uniform(p + g + [t for m in moments for t in m]):
        return None
    if not _same_layouts(p, [g, *moments]):
        return None
    return p, g, moments


def eager_kernels_ok() -> bool:
    """True in plain eager mode: not being compiled, not inside a torch.func transform."""
    return (not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is None)


def fused_supported(spec: FusedSpec | None, params: Any, grads: Any, state: Any) -> bool:
    """Whether :func:`fused_step_` applies: eager mode, uniform trees, the same formulas.

    Under ``torch.compile`` the pure path is used instead: inductor fuses it (and the
    donation's copies) itself, and functionalization rejects these in-place kernels on
    the step's inputs (torch 2.13).
    """
    if spec is None or not eager_kernels_ok():
        return False
    return _lists(spec, params, grads, state) is not None


def fused_step_(spec: FusedSpec, params: Any, grads: Any, state: Any,
                grad_scale: torch.Tensor | None, found_inf: torch.Tensor) -> Any | None:
    """Run the fused kernel in place; return the new optimizer state, or None if unsupported.

    Args:
        spec: the optimizer's :class:`FusedSpec`.
        params: the params tree (overwritten in place).
        grads: grads of the same structure, still multiplied by ``grad_scale``.
        state: the optimizer state (its moment tensors are overwritten in place).
        grad_scale: 0-d float32 tensor the grads are divided by, or None.
        found_inf: 0-d float32 tensor, 1.0 to skip the update (nothing is written).

    Returns:
        The new state (new count tensor; the moment trees are the same tensors), or None
        when the fused kernel does not apply; then nothing has been touched.
    """
    lists = _lists(spec, params, grads, state)
    if lists is None:
        return None
    p, g, moments = lists
    count = state.count
    finite_i = (found_inf == 0).to(count.dtype)
    lr = spec.hp["lr_at"](count)
    kw: dict[str, Any] = {"grad_scale": None if grad_scale is None else grad_scale.reshape(1),
                          "found_inf": found_inf.reshape(1)}
    if spec.kind in ("adam", "adamw"):
        hp = spec.hp
        mu, nu, nu_max = moments
        steps = [(count + 1).to(torch.float32)] * len(p)
        fn = torch._fused_adamw_ if spec.kind == "adamw" else torch._fused_adam_
        fn(p, g, mu, nu, nu_max, steps, lr=lr, beta1=hp["b1"], beta2=hp["b2"],
           weight_decay=hp["wd"], eps=hp["eps"], amsgrad=hp["amsgrad"], maximize=False, **kw)
        return state._replace(count=count + finite_i)
    if spec.kind == "sgd":
        hp = spec.hp
        (buf,) = moments
        torch._fused_sgd_(p, g, buf, weight_decay=hp["wd"], momentum=hp["momentum"], lr=lr,
                          dampening=0.0, nesterov=hp["nesterov"], maximize=False,
                          is_first_step=False, **kw)
        return state._replace(count=count + finite_i)
    return None
