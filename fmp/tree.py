"""Pytree utilities over optree: casts, the finite check and the branch-free select.

None is treated as an empty subtree (optree's default), so a params dict may hold None
for a parameter that has no gradient and it passes through every function here.
"""

from __future__ import annotations

from typing import Any, TypeVar

import optree
import torch

from fmp._batched import foreach_copy_
from fmp.dtypes import dtype as _dtype

__all__ = ["all_finite", "cast_tree", "copy_tree_", "floating_leaves", "select_tree"]

T = TypeVar("T")


def cast_tree(tree: T, dtype: str | torch.dtype) -> T:
    """Cast every floating-point tensor leaf of ``tree`` to ``dtype``.

    Integer and bool tensors, Python scalars, None and any other object pass through
    unchanged. The input tree is not modified; a leaf already of ``dtype`` is returned
    as the same tensor (no copy).

    Args:
        tree: any pytree (dicts, lists, tuples, NamedTuples, registered records).
        dtype: a ``torch.dtype`` or a name accepted by :func:`fmp.dtype`.

    Returns:
        A new tree of the same structure.

    Raises:
        ValueError: ``dtype`` is not an accepted floating dtype.

    Example:
        >>> fmp.cast_tree({"w": torch.ones(2), "n": torch.arange(2)}, "bf16")["w"].dtype
        torch.bfloat16
    """
    d = _dtype(dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != d:
            return x.to(d)
        return x

    return optree.tree_map(cast, tree)


def floating_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensor leaves of ``tree``, in flatten order."""
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)
            and x.is_floating_point()]


def _complex_error(tree: Any) -> TypeError:
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    name = next(".".join(map(str, p)) or "<root>" for p, x in zip(paths, leaves, strict=True)
                if isinstance(x, torch.Tensor) and x.is_complex())
    dt = next(x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_complex())
    return TypeError(
        f"all_finite: leaf {name!r} is a {dt} tensor; fmp does not support complex params or "
        "grads (loss scaling, casts and the optimizers handle real floating tensors only, "
        "and a complex leaf must not be left out of the finite check). Keep a complex "
        "parameter as a real tensor with a trailing dimension of 2 (torch.view_as_real / "
        "torch.view_as_complex inside the model)"
    )


def all_finite(tree: Any) -> torch.Tensor:
    """Whether every floating-point tensor leaf of ``tree`` is free of inf and NaN.

    One multi-tensor reduction (``torch._foreach_norm`` with ord=inf, which propagates
    NaN and inf), then one reduction over the per-tensor results. It never calls
    ``.item()``, so it does not synchronise the host and can be traced by
    ``torch.compile(fullgraph=True)`` and captured in a CUDA graph. float64 leaves are
    reduced in float64 (a finite float64 value beyond float32's range is finite);
    zero-element leaves hold no value and are finite.

    Args:
        tree: any pytree; integer, bool and non-tensor leaves are ignored.

    Returns:
        A 0-d bool tensor on the leaves' device (CPU for a tree with no floating
        leaves, and then True).

    Raises:
        TypeError: a leaf is a complex tensor (fmp supports real floating dtypes only; the
            message names the leaf).

    Example:
        >>> fmp.all_finite({"a": torch.ones(3), "b": torch.tensor([float("nan")])})
        tensor(False)
    """
    all_leaves = optree.tree_leaves(tree)
    leaves = [x for x in all_leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if len(leaves) != len(all_leaves) and any(
            isinstance(x, torch.Tensor) and x.is_complex() for x in all_leaves):
        raise _complex_error(tree)
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    device = leaves[0].device
    if any(x.numel() == 0 for x in leaves):  # no identity for an empty inf-norm
        leaves = [x for x in leaves if x.numel() != 0]
        if not leaves:
            return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([_on(n, device) for n in inf_norms(leaves)]).isfinite().all()


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def inf_norms(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's largest ``|x|`` (NaN where it holds a NaN), in the leaves' order, from
    one multi-tensor ``torch._foreach_norm`` per width: float64 leaves in float64, the
    others in float32 (exact for narrower dtypes; _foreach_norm's float32 accumulation
    refuses to narrow float64, and a finite float64 value beyond float32's range must stay
    finite). The leaves are floating tensors with at least one element.
    """
    out: list[torch.Tensor | None] = [None] * len(leaves)
    wide = [i for i, x in enumerate(leaves) if x.dtype == torch.float64]
    rest = [i for i, x in enumerate(leaves) if x.dtype != torch.float64]
    for idx, kw in ((wide, {}), (rest, {"dtype": torch.float32})):
        if idx:
            got = torch._foreach_norm([leaves[i] for i in idx], float("inf"), **kw)
            for i, n in zip(idx, got, strict=True):
                out[i] = n
    return out  # type: ignore[return-value]


def to_dtypes_of(tree: T, like: Any) -> T:
    """``tree`` with each tensor leaf converted to the dtype of ``like``'s matching leaf
    (grads of a compute copy turned into their params' dtypes, as the cast's backward
    would); leaves already of that dtype, and non-tensor leaves, are kept."""
    def conv(g: Any, p: Any) -> Any:
        if isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor) and g.dtype != p.dtype:
            return g.to(p.dtype)
        return g

    return optree.tree_map(conv, tree, like)


def copy_tree_(dst: T, src: Any) -> T:
    """Copy ``src``'s tensor leaves into ``dst``'s tensors in place, converting dtypes.

    One multi-tensor copy per (device, dtype pair), where ``torch._foreach_copy_`` on a list
    that mixes dtypes copies tensor by tensor (a kernel each: the master-weight copy of a
    model with float32 norms and float16 weights, or float32 statistics beside int64
    counts). Values are those ``dst_leaf.copy_(src_leaf)`` gives.

    Args:
        dst: a tree of tensors, written in place.
        src: a tree of the same structure; each leaf a tensor of its ``dst`` leaf's shape.

    Returns:
        ``dst``.

    Raises:
        ValueError: the trees differ in structure, or a pair of leaves in shape or in being
            a tensor (the message names the leaf).

    Example:
        >>> d = {"w": torch.zeros(2, dtype=torch.float16), "n": torch.zeros((), dtype=torch.int64)}
        >>> fmp.copy_tree_(d, {"w": torch.tensor([0.5, 2.0]), "n": torch.tensor(3)})
        {'w': tensor([0.5000, 2.0000], dtype=torch.float16), 'n': tensor(3)}
    """
    if type(dst) is list and type(src) is list and len(dst) == len(src) and all(
            type(d) is torch.Tensor and type(s) is torch.Tensor and d.shape == s.shape
            for d, s in zip(dst, src, strict=True)):
        foreach_copy_(dst, src)  # the adapter's hot path: lists of tensors
        return dst
    paths, d_leaves, spec = optree.tree_flatten_with_path(dst)
    s_leaves, s_spec = optree.tree_flatten(src)
    if s_spec != spec:
        raise ValueError(f"copy_tree_: the trees differ in structure:\n  dst: {spec}\n"
                         f"  src: {s_spec}")
    for p, d, s in zip(paths, d_leaves, s_leaves, strict=True):
        if not (isinstance(d, torch.Tensor) and isinstance(s, torch.Tensor)
                and d.shape == s.shape):
            what = lambda x: (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor)  # noqa: E731
                              else type(x).__name__)
            raise ValueError(f"copy_tree_: leaf {'.'.join(map(str, p)) or '<root>'!r} is "
                             f"{what(s)} in src and {what(d)} in dst; each pair must be "
                             "tensors of one shape")
    foreach_copy_(d_leaves, s_leaves)
    return dst


def select_tree(pred: torch.Tensor, on_true: T, on_false: T) -> T:
    """Leafwise ``torch.where(pred, a, b)`` over two trees of the same structure.

    Tensor leaves are selected on the device, without a host sync. Non-tensor leaves
    (Python numbers, strings) must be equal in both trees and are kept.

    Args:
        pred: a 0-d bool tensor.
        on_true: the tree returned where ``pred`` is True.
        on_false: a tree of the same structure, returned where ``pred`` is False.

    Returns:
        A new tree; each tensor leaf keeps the dtype of ``on_true``'s leaf.

    Raises:
        ValueError: ``pred`` is not a 0-d bool tensor, or the trees differ in structure
            (the message shows both structures), in a leaf's shape (the message names the
            leaf) or in a non-tensor leaf.

    Example:
        >>> fmp.select_tree(torch.tensor(False), {"w": torch.ones(2)}, {"w": torch.zeros(2)})
        {'w': tensor([0., 0.])}
    """
    if not (isinstance(pred, torch.Tensor) and pred.dtype == torch.bool and pred.dim() == 0):
        raise ValueError(
            f"select_tree needs a 0-d bool tensor as pred, got "
            f"{type(pred).__name__}"
            + (f" of dtype {pred.dtype} and shape {tuple(pred.shape)}"
               if isinstance(pred, torch.Tensor) else "")
        )
    leaves_t, spec_t = optree.tree_flatten(on_true)
    leaves_f, spec_f = optree.tree_flatten(on_false)
    # Dynamo in torch 2.11 cannot trace PyTreeSpec.__eq__; compiled code compares leaf
    # counts (the eager run that precedes or mirrors it compares the full structures).
    if (len(leaves_t) != len(leaves_f) if torch.compiler.is_compiling()
            else spec_t != spec_f):
        raise ValueError(
            f"select_tree needs trees of one structure; on_true is {spec_t}, "
            f"on_false is {spec_f}"
        )
    out = []
    for i, (a, b) in enumerate(zip(leaves_t, leaves_f, strict=True)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:  # torch.where would broadcast them into a new shape
                name = ".".join(map(str, spec_t.paths()[i])) or "<root>"
                raise ValueError(
                    f"select_tree: leaf {name!r} has shape {tuple(a.shape)} in on_true and "
                    f"{tuple(b.shape)} in on_false; each leaf must have one shape in both "
                    "trees (a state whose params changed shape needs a new optimizer state)"
                )
            out.append(torch.where(pred, a, b.to(a.dtype) if b.dtype != a.dtype else b))
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            raise ValueError(
                f"select_tree: leaf {i} is a tensor in one tree and "
                f"{type(b if isinstance(a, torch.Tensor) else a).__name__} in the other"
            )
        else:
            if a is not b and a != b:
                raise ValueError(
                    f"select_tree: non-tensor leaf {i} differs ({a!r} vs {b!r}); "
                    "only tensor leaves can be selected"
                )
            out.append(a)
    return optree.tree_unflatten(spec_t, out)
