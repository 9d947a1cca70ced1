"""The train step's work on whole trees: param dtype checks, micro-batches, aux stacking,
grad dtype conversions, donation into the input state's tensors, the private state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from fmp._batched import foreach_copy_, select_copy, where_as
from fmp._donation import all_owned, private
from fmp._eager import eager_kernels_ok
from fmp._train_state import TrainState
from fmp.policy import Policy
from fmp.tree import select_tree


def check_param_dtypes(params: Any, pol: Policy,
                        param_policies: Mapping[str, Policy] | None) -> None:
    """A param stored in another dtype than its policy says is a bug: say so, name it."""
    if param_policies is None:  # the common case, every step: names only for the error
        want = pol.param_dtype
        if type(params) is dict and all(  # a dict of tensors (fmp.functional's): one pass
                type(v) is torch.Tensor and (v.dtype == want or not v.is_floating_point())
                for v in params.values()):
            return
        if all(v.dtype == want for v in optree.tree_leaves(params)
               if isinstance(v, torch.Tensor) and v.is_floating_point()):
            return
    if param_policies is not None and isinstance(params, Mapping):
        items = [(k, v, param_policies[k].param_dtype) for k, v in params.items()
                 if k in param_policies]
    else:
        paths, leaves, _ = optree.tree_flatten_with_path(params)
        items = [(".".join(map(str, p)), v, pol.param_dtype) for p, v in zip(paths, leaves,
                                                                              strict=True)]
    for name, v, want in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != want:
            raise ValueError(
                f"param {name!r} is {v.dtype} but the policy keeps params in {want}; cast "
                "them before TrainState.create, e.g. params = policy.cast_to_param(params)"
            )


def split_batch(batch: tuple[Any, ...], k: int) -> list[tuple[Any, ...]]:
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    chunks = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % k:
                raise ValueError(f"accumulate={k}: batch leaf {i} has leading size "
                                 f"{x.shape[0]}, which is not divisible by {k}")
            chunks.append(torch.chunk(x, k, dim=0))
        else:
            chunks.append((x,) * k)
    return [optree.tree_unflatten(spec, [c[j] for c in chunks]) for j in range(k)]


def stack_aux(auxes: list[Any]) -> Any:
    """The k micro-batches' aux values as one: tensor leaves stacked along a new dim 0 (in
    micro-batch order), other leaves as a tuple of the k values."""
    leaves0, spec = optree.tree_flatten(auxes[0])
    rows = [spec.flatten_up_to(a) for a in auxes[1:]]
    out = []
    for i, x in enumerate(leaves0):
        column = [x] + [r[i] for r in rows]
        if isinstance(x, torch.Tensor):
            out.append(torch.stack(column))
        else:
            out.append(tuple(column))
    return optree.tree_unflatten(spec, out)


def to_f32(g: Any) -> Any:
    return g.float() if isinstance(g, torch.Tensor) and g.is_floating_point() else g


def donate_into(old: Any, new: Any) -> Any:
    """Write ``new``'s tensor leaves into ``old``'s tensors in place; return ``old``'s tree.

    ``_foreach_copy_`` converts dtypes: donating params into their compute copy casts them.
    """
    dst, src = [], []
    if torch.compiler.is_compiling():  # one tree_map (see _select_into_compiled)
        def pair(o: Any, n: Any) -> Any:
            if isinstance(o, torch.Tensor) and o is not n:
                dst.append(o)
                src.append(n)
            return o

        optree.tree_map(pair, old, new)
    else:
        old_leaves, spec = optree.tree_flatten(old)
        for o, n in zip(old_leaves, spec.flatten_up_to(new), strict=True):
            if isinstance(o, torch.Tensor) and o is not n:
                dst.append(o)
                src.append(n)
    if dst and torch.compiler.is_compiling():
        torch._foreach_copy_(dst, src)
    elif dst:  # a dtype group at a time: torch copies a mixed list tensor by tensor
        foreach_copy_(dst, src)
    return old


def private_state(state: TrainState) -> TrainState:
    """``state`` whose params, optimizer and model state a donated step may write into: a
    copy of every tensor no fmp step handed out (the module's, another state's)."""
    if all_owned((state.params, state.opt_state, state.model_state)):
        return state  # every step after the first: one walk
    params, opt_state = private(state.params), private(state.opt_state)
    model_state = private(state.model_state)
    if (params is state.params and opt_state is state.opt_state
            and model_state is state.model_state):
        return state
    return state._replace(params=params, opt_state=opt_state, model_state=model_state,
                          compute_params=(state.compute_params if params is state.params
                                          else None))


def select_into(pred: torch.Tensor, new: Any, old: Any) -> Any:
    """``donate_into(old, select_tree(pred, new, old))`` (a donated step's skip-safe write)
    in one walk of the two trees: the same selects, copied into ``old``'s tensors."""
    if torch.compiler.is_compiling():
        return _select_into_compiled(pred, new, old)
    old_leaves, spec = optree.tree_flatten(old)
    new_leaves, new_spec = optree.tree_flatten(new)
    ok = (isinstance(pred, torch.Tensor) and pred.dtype == torch.bool and pred.dim() == 0
          and new_spec == spec)
    for a, b in zip(new_leaves, old_leaves, strict=True) if ok else ():
        if not (type(a) is torch.Tensor and type(b) is torch.Tensor and a.shape == b.shape):
            ok = False  # select_tree's rules (and errors) for anything else
            break
    if not ok:
        return donate_into(old, select_tree(pred, new, old))
    if eager_kernels_ok():  # small leaves of one dtype: one where for all (fmp/_batched.py)
        select_copy(pred, new_leaves, old_leaves)
        return old
    dst, src = [], []
    for a, b in zip(new_leaves, old_leaves, strict=True):
        dst.append(b)
        src.append(where_as(pred, a, b))
    if dst:
        torch._foreach_copy_(dst, src)
    return old


def _select_into_compiled(pred: torch.Tensor, new: Any, old: Any) -> Any:
    """:func:`select_into` under torch.compile: the same selects and copies, the leaves
    paired by one ``optree.tree_map``; anything but a pair of tensors of one shape goes
    through ``select_tree`` for its rules and errors.

    Dynamo (torch 2.13) traces ``optree.tree_map`` through a fast path of its own, but
    ``tree_flatten``, ``tree_unflatten`` and ``flatten_up_to`` through Python polyfills that
    build a spec object for every node: about 5 ms a leaf for a flatten on a 2-core CPU,
    some 10 times a tree_map's cost. The donated step's writes walk the params, the
    optimizer state and the compute copy, so under compile they (and :func:`donate_into`)
    pair the leaves with one tree_map each (the pairs' order is free: each is its own copy).
    """
    ok = [isinstance(pred, torch.Tensor) and pred.dtype == torch.bool and pred.dim() == 0]
    dst, src = [], []

    def pair(a: Any, b: Any) -> Any:
        if type(a) is torch.Tensor and type(b) is torch.Tensor and a.shape == b.shape:
            dst.append(b)
            src.append(where_as(pred, a, b))
        else:
            ok[0] = False
        return b

    if ok[0]:
        optree.tree_map(pair, new, old)
    if not ok[0]:
        return donate_into(old, select_tree(pred, new, old))
    if dst:
        torch._foreach_copy_(dst, src)
    return old
