"""Many small tensors, few kernels: the eager step's clone and select of model state.

A BatchNorm network carries hundreds of small buffers (ResNet-50: 159). The skip-safe step
clones them before the forward updates them and, after the update, writes
``where(finite, new, old)`` back into the state's tensors: one kernel per buffer each
way, some 320 launches of a few hundred bytes each, enough to leave the GPU waiting on
the host. Grouped by device and dtype, the clone is one ``_foreach_copy_`` into fresh
tensors, and the select is one ``where`` over the group's flat concatenation copied back
with one ``_foreach_copy_``: the same values, bit for bit, in a handful of launches.
:func:`foreach_copy_` is the multi-tensor copy the whole step uses: torch's copies a list
that mixes dtypes one tensor at a time.

Only eager mode takes these paths: under ``torch.compile`` the per-tensor forms fuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: a leaf of more elements than this is selected on its own: batching it would add the
#: traffic of two concatenations for no launch saved worth having
SMALL = 1 << 16

#: the select batches on accelerators only: there a kernel launch costs microseconds of
#: host time, while on a CPU an op is a function call and a ``where`` over one long
#: concatenation is slower than many short ones (ResNet-50's buffers, 2 cores: 1.3 ms
#: against 0.4 ms). Tests turn it on to check the batched path on CPU.
BATCH_ON_CPU = False


def where_as(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.where(pred, a, b)`` in ``a``'s dtype (``b`` converted where it differs)."""
    return torch.where(pred, a, b.to(a.dtype) if b.dtype != a.dtype else b)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_(dst, src)`` a (device, dtypes) group at a time.

    torch's multi-tensor copy takes its fast path (a few kernels for a whole list) only
    where every tensor of the list has one dtype; one list that mixes them (float32 running
    means with int64 counts, float16 weights with float32 norm params) is copied tensor by
    tensor, a ``cudaMemcpy`` each: 159 for ResNet-50's buffers (H100 profile, torch 2.11).

    Example:
        >>> d = [torch.zeros(2), torch.zeros((), dtype=torch.int64)]
        >>> foreach_copy_(d, [torch.ones(2), torch.tensor(3)])
        >>> d
        [tensor([1., 1.]), tensor(3)]
    """
    for d, s in copy_groups(dst, src):
        torch._foreach_copy_(d, s)


def copy_groups(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
                ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The ``(dst, src)`` lists :func:`foreach_copy_` copies, one per (device, dtypes)
    group (a caller that copies the same pairs again and again keeps them)."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        g = groups.setdefault((d.device, d.dtype, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    return list(groups.values())


def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (each its own storage, strides and dtype kept), a (device,
    dtype) group at a time: ``torch._foreach_clone`` where torch has it (one call
    allocates and copies the group), else fresh tensors and one ``_foreach_copy_``.

    Example:
        >>> a, b = clone_all([torch.ones(2), torch.zeros((), dtype=torch.int64)])
        >>> a, b
        (tensor([1., 1.]), tensor(0))
    """
    clone = getattr(torch, "_foreach_clone", None)
    if clone is None or not tensors:
        out = [torch.empty_like(t, memory_format=torch.preserve_format) for t in tensors]
        if out:
            with torch.no_grad():
                foreach_copy_(out, tensors)
        return out
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    res: list[torch.Tensor | None] = [None] * len(tensors)
    with torch.no_grad():
        for idx in groups.values():
            for i, c in zip(idx, clone([tensors[i] for i in idx]), strict=True):
                res[i] = c
    return res  # type: ignore[return-value]


def select_copy(pred: torch.Tensor, new: Sequence[torch.Tensor],
                old: Sequence[torch.Tensor]) -> None:
    """Write ``where(pred, new[i], old[i])`` into each ``old[i]``, in place.

    Pairs must have one shape; ``new[i]``'s dtype is the result's (``old[i]`` takes it
    back on the copy, as ``copy_`` converts). Small contiguous pairs of one device and
    dtype on an accelerator are selected together: one concatenation of each side, one
    ``where``, one ``_foreach_copy_``; the rest pair by pair.

    Example:
        >>> old = [torch.zeros(2), torch.zeros(3)]
        >>> select_copy(torch.tensor(True), [torch.ones(2), torch.ones(3)], old)
        >>> old
        [tensor([1., 1.]), tensor([1., 1., 1.])]
    """
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for i, (a, b) in enumerate(zip(new, old, strict=True)):
        if (a.dtype == b.dtype and a.device == b.device and a.numel() <= SMALL
                and (BATCH_ON_CPU or a.device.type != "cpu")
                and a.is_contiguous() and b.is_contiguous()):
            groups.setdefault((a.device, a.dtype, a.dim() == 0), []).append(i)
        else:
            dst.append(b)
            src.append(where_as(pred, a, b))
    for (_, _, scalars), idx in groups.items():
        if len(idx) == 1:
            i = idx[0]
            dst.append(old[i])
            src.append(torch.where(pred, new[i], old[i]))
            continue
        dst.extend(old[i] for i in idx)
        if scalars:  # 0-d (a BatchNorm's count): stacked, and unbound back to 0-d views
            src.extend(torch.where(pred, torch.stack([new[i] for i in idx]),
                                   torch.stack([old[i] for i in idx])).unbind())
            continue
        flat = torch.where(pred, torch.cat([_flat(new[i]) for i in idx]),
                           torch.cat([_flat(old[i]) for i in idx]))
        parts = flat.split([old[i].numel() for i in idx])
        src.extend(part if old[i].dim() == 1 else part.view(old[i].shape)
                   for i, part in zip(idx, parts, strict=True))
    foreach_copy_(dst, src)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)
