"""The arithmetic of scaling: the loss times the scale, grads times its exact reciprocal."""

from __future__ import annotations

from typing import Any, TypeVar

import optree
import torch

from fmp.tree import inf_norms

T = TypeVar("T")

_LOW_PRECISION_ITEMSIZE = 4  # floating dtypes narrower than float32 are computed in float32


def inverse(divisor: torch.Tensor) -> torch.Tensor:
    """``1 / divisor`` as a float32 tensor, computed as ``torch.amp.GradScaler`` does.

    The reciprocal is taken in float64 and rounded once to float32 (MPS has no float64:
    there in float32). For a float32 divisor this is the correctly rounded float32
    reciprocal, whichever backend (or compiled kernel) evaluates it.

    Example:
        >>> inverse(torch.tensor(3.0)) == torch.tensor(1 / 3, dtype=torch.float32)
        tensor(True)
    """
    if divisor.device.type == "mps":
        return torch.reciprocal(divisor.to(torch.float32))
    return torch.reciprocal(divisor.to(torch.float64)).to(torch.float32)


def _is_low_precision(x: torch.Tensor) -> bool:
    return x.dtype.itemsize < _LOW_PRECISION_ITEMSIZE


def on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (``t`` itself when it is there)."""
    return t if t.device == device else t.to(device)


def scale_tree(tree: T, scale: torch.Tensor) -> T:
    """Multiply every floating tensor leaf by ``scale``; narrow floats are promoted to f32."""
    leaves, spec = optree.tree_flatten(tree)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            s = on(scale, x.device)
            out.append((x.to(torch.float32) if _is_low_precision(x) else x) * s)
        else:
            out.append(x)
    return optree.tree_unflatten(spec, out)


def unscale_tree(tree: T, scale: torch.Tensor) -> T:
    """Multiply every floating tensor leaf by ``1/scale`` (f32), keeping each leaf's dtype."""
    leaves, spec = optree.tree_flatten(tree)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            groups.setdefault((x.device, x.dtype), []).append(i)
    if not groups:
        return tree
    inv = inverse(scale)
    out = list(leaves)
    for (device, dtype), idx in groups.items():
        inv_d = on(inv, device)
        xs = [leaves[i] for i in idx]
        if dtype.itemsize < _LOW_PRECISION_ITEMSIZE:
            # On CUDA a float32 0-d tensor times a bf16/fp16 tensor is rounded to the
            # narrow dtype first (1/2**25 is 0 in fp16); multiply in float32 instead.
            ys = [x.to(torch.float32) for x in xs]
            torch._foreach_mul_(ys, inv_d)
            ys = [y.to(dtype) for y in ys]
        else:
            ys = torch._foreach_mul(xs, inv_d)
        for i, y in zip(idx, ys, strict=True):
            out[i] = y
    return optree.tree_unflatten(spec, out)


def per_micro_batch(tree: T, micro_batches: int) -> T:
    """The (unscaled) sum over ``micro_batches`` micro-batches as their mean: every leaf
    times the Python float ``1/micro_batches`` (nothing to do for one)."""
    if micro_batches == 1:
        return tree
    inv_k = 1.0 / micro_batches

    def mean(g: Any) -> Any:
        return g * inv_k

    return optree.tree_map(mean, tree)


def finite_after_unscale(leaves: list[torch.Tensor], out_dtypes: list[torch.dtype],
                         scale: torch.Tensor | None) -> torch.Tensor:
    """Whether :func:`unscale_tree` of ``leaves`` (each first converted to its out dtype)
    would be all finite, read from ``leaves`` themselves.

    Converting, multiplying by the positive ``1/scale`` and rounding are monotone in
    ``|x|``, so a leaf's unscaled values are all finite exactly when the unscaled value
    of its largest ``|x|`` is (NaN propagates through the inf-norm): one multi-tensor
    inf-norm of the leaves, then that arithmetic on one number per leaf. The verdict is
    the one :func:`fmp.all_finite` gives on the unscaled tree, without that tree being
    read: in a compiled step the conversion and the unscale then fuse into their one
    consumer, the update, instead of being written out for the check. A mean over
    micro-batches (times ``1/k <= 1``) cannot make a finite value infinite.

    Args:
        leaves: floating tensors with at least one element, on one device.
        out_dtypes: the dtype each leaf is converted to before unscaling.
        scale: the 0-d scale, or None (no scaling: only the conversion).

    Returns:
        A 0-d bool tensor on the leaves' device.
    """
    device = leaves[0].device
    norms = inf_norms(leaves)
    inv = None if scale is None else on(inverse(scale), device)
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (x, d) in enumerate(zip(leaves, out_dtypes, strict=True)):
        groups.setdefault((x.dtype, d), []).append(i)
    oks = []
    for (src, dst), idx in groups.items():
        # the largest |x| of each leaf: exact in float32 (float64 for float64 leaves)
        m = torch.stack([on(norms[i], device) for i in idx])
        v = m if src == dst else m.to(dst)  # the conversion (exact where it widens)
        if inv is not None:
            if dst.itemsize < _LOW_PRECISION_ITEMSIZE:  # as unscale_tree: in float32
                v = (v.to(torch.float32) * inv).to(dst)
            else:
                v = v * inv
        oks.append(v.isfinite().all())
    ok = oks[0]
    for o in oks[1:]:
        ok = ok & o
    return ok
