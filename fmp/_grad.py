"""Gradient of a scalar function of a params tree, with auxiliary outputs.

Two engines compute the same function:

- ``torch.func.grad``: traceable by ``torch.compile(fullgraph=True)`` and composable with
  other torch.func transforms; used whenever the step is being compiled or runs inside a
  transform.
- ``torch.autograd.grad`` on detached aliases of the params: used in plain eager mode,
  where it keeps every fast kernel (fused attention, cuDNN) and torch.func's per-op
  wrapping costs nothing. The caller's tensors are never marked as requiring grad.

Aux outputs may hold any pytree; tensors in it come back detached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

#: "auto" picks per call as described above; "func" or "autograd" force one (benchmarks).
ENGINE = "auto"


def _use_func() -> bool:
    if ENGINE != "auto":
        return ENGINE == "func"
    if torch.compiler.is_compiling():
        return True
    return torch._C._functorch.peek_interpreter_stack() is not None


def grad_with_aux(f: Callable[[Any], tuple[torch.Tensor, Any]], params: Any
                  ) -> tuple[Any, Any]:
    """``(grad of f(params)[0] w.r.t. params, f(params)[1])``; unused params get zero grads."""
    if _use_func():
        return _func_grad(f, params)
    return _autograd_grad(f, params)


def _func_grad(f: Callable[[Any], tuple[torch.Tensor, Any]], params: Any) -> tuple[Any, Any]:
    # torch.func.grad's aux takes tensors only: pass the tensor leaves through it and rebuild
    # the rest (None, Python values) outside.
    side: dict[str, Any] = {}

    def g(p: Any):
        out, aux = f(p)
        leaves, spec = optree.tree_flatten(aux)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        side.update(spec=spec, is_t=is_t,
                    other=[x for x, t in zip(leaves, is_t, strict=True) if not t])
        return out, [x for x, t in zip(leaves, is_t, strict=True) if t]

    grads, tensors = torch.func.grad(g, has_aux=True)(params)
    it_t, it_o = iter(tensors), iter(side["other"])
    leaves = [next(it_t) if t else next(it_o) for t in side["is_t"]]
    return grads, optree.tree_unflatten(side["spec"], leaves)


def _autograd_grad(f: Callable[[Any], tuple[torch.Tensor, Any]], params: Any
                   ) -> tuple[Any, Any]:
    leaves, spec = optree.tree_flatten(params)
    with torch.enable_grad():
        alias = [x.detach().requires_grad_() for x in leaves]
        out, aux = f(optree.tree_unflatten(spec, alias))
        grads = torch.autograd.grad(out, alias, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    # a tensor that does not require grad has no graph to cut (model state: hundreds)
    aux = optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor)
                          and x.requires_grad else x, aux)
    return optree.tree_unflatten(spec, grads), aux
