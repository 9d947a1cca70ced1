"""Data parallelism over torch.distributed: bucketed grad all-reduce and agreed finite checks.

torch.distributed's own engines do the communication: the reductions here are
``torch.distributed._functional_collectives`` all-reduces (traceable by
``torch.compile(fullgraph=True)``, pure: they return new tensors), DDP and FSDP2 are used as
they are, and :func:`fsdp_mixed_precision` maps an :class:`fmp.Policy` onto FSDP2's
``MixedPrecisionPolicy``. Nothing here calls ``.item()``: the step stays free of host syncs.

The rule that keeps replicas together: every rank must make the same skip decision.
:func:`all_finite` all-reduces the verdict, so one rank's inf makes every rank skip; with
sharded grads (FSDP2) each rank sees only its shard, and the reduced verdict is the only
correct one.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import optree
import torch

from fmp._fsdp import fsdp_mixed_precision
from fmp.dtypes import dtype as _dtype
from fmp.tree import all_finite as _local_all_finite

__all__ = ["GroupReducer", "all_finite", "all_reduce_grads", "check_group", "check_same_tree",
           "fsdp_mixed_precision", "is_dtensor"]

T = TypeVar("T")

#: Default bucket size for :func:`all_reduce_grads`, as DDP's ``bucket_cap_mb``.
BUCKET_MB = 25.0

# (process group, tree signature) pairs that the module's functions, called on their own,
# already checked to agree across ranks (a step's GroupReducer keeps its own set). The group
# object is part of the key, so the entry holds it alive and its id cannot be reused.
_CHECKED: set[tuple[Any, Any]] = set()


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def check_group(group: Any = None) -> Any:
    """Check that collectives can run on ``group``; return the group to pass to them.

    Args:
        group: a ``torch.distributed.ProcessGroup``, ``None`` or ``"default"`` (the default
            group).

    Returns:
        The ``ProcessGroup`` (the default one for ``None`` / ``"default"``).

    Raises:
        RuntimeError: torch.distributed is not available in this build, the default
            process group is not initialised (call ``torch.distributed.init_process_group``
            first, e.g. under ``torchrun``), or this rank is not a member of ``group``.
        TypeError: ``group`` is neither a ProcessGroup, None nor ``"default"``.

    Example:
        >>> fmp.distributed.check_group()  # without init_process_group  # doctest: +SKIP
        RuntimeError: fmp.distributed: torch.distributed is not initialised; ...
    """
    dist = _dist()
    if not dist.is_available():
        raise RuntimeError("fmp.distributed: this torch build has no torch.distributed "
                           "(torch.distributed.is_available() is False)")
    if isinstance(group, str):
        if group != "default":
            raise TypeError(f"fmp.distributed: process_group must be a torch.distributed "
                            f"ProcessGroup, None or 'default', got the string {group!r}")
        group = None
    if not dist.is_initialized():
        raise RuntimeError(
            "fmp.distributed: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(backend) first (e.g. launch with torchrun "
            "and use 'gloo' on CPU or 'nccl' on GPUs), or pass process_group=None for a "
            "single process"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"fmp.distributed: process_group must be a torch.distributed "
                        f"ProcessGroup, None or 'default', got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise RuntimeError(f"fmp.distributed: this rank (global rank {dist.get_rank()}) is "
                           f"not a member of process group {group.group_name!r}")
    return group


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded tensors).

    Args:
        x: any object.

    Returns:
        True for a DTensor; False otherwise, and on a torch build without DTensor.

    Example:
        >>> fmp.distributed.is_dtensor(torch.ones(2))
        False
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(x, DTensor)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _wait(t: torch.Tensor) -> torch.Tensor:
    """The plain result of a functional collective (eager: wait for it; traced: as is)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _all_reduce(t: torch.Tensor, reduce_op: str, pg: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_reduce

    return _wait(all_reduce(t, reduce_op, pg))


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    return type(x).__name__


def check_same_tree(tree: Any, group: Any = None) -> None:
    """Check that every rank holds a tree of one structure, leaf shapes and dtypes.

    A collective over buffers of different sizes can hang or reduce garbage; this check
    turns such a mismatch into an error on every rank. It gathers a small signature with
    ``torch.distributed.all_gather_object`` (a host sync), once per (group, signature):
    later calls with the same tree signature return at once. :func:`all_reduce_grads`
    calls it (outside ``torch.compile`` tracing; under compile, run one eager call first
    or call this yourself).

    Args:
        tree: the pytree (e.g. the grads) this rank is about to reduce.
        group: a ProcessGroup, None or ``"default"``.

    Raises:
        ValueError: on every rank, when some rank's tree differs from rank 0's; the message
            names the first such rank and the first difference (structure, leaf count, or
            a leaf's path, dtype and shape).
        RuntimeError: the group is not usable (see :func:`check_group`).

    Example:
        >>> fmp.distributed.check_same_tree({"w": torch.ones(3)})  # doctest: +SKIP
    """
    _check_same_tree(tree, check_group(group), _CHECKED)


def _check_same_tree(tree: Any, pg: Any, checked: set[tuple[Any, Any]]) -> None:
    """:func:`check_same_tree` on the group ``pg``, skipped for a signature in ``checked``
    (to which it adds the signature once every rank agrees)."""
    leaves, spec = optree.tree_flatten(tree)
    key = (pg, spec, tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor)
                           else type(x) for x in leaves))
    if key in checked:
        return
    dist = _dist()
    names = [".".join(map(str, p)) or "<root>" for p in optree.tree_paths(tree)]
    mine = (str(spec), [(n, _describe(x)) for n, x in zip(names, leaves, strict=True)])
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, mine, group=pg)
    ref = gathered[0]
    for rank, sig in enumerate(gathered[1:], start=1):
        if sig == ref:
            continue
        if len(sig[1]) != len(ref[1]):
            what = f"rank 0 has {len(ref[1])} leaves, rank {rank} has {len(sig[1])}"
        else:
            diff = [(a, b) for a, b in zip(ref[1], sig[1], strict=True) if a != b]
            if diff:
                (n0, d0), (n1, d1) = diff[0]
                what = (f"leaf {n0!r} is {d0} on rank 0 but leaf {n1!r} is {d1} on rank "
                        f"{rank}" if n0 != n1 else
                        f"leaf {n0!r} is {d0} on rank 0 but {d1} on rank {rank}")
            else:
                what = "their structures differ"
        if sig[0] != ref[0]:
            what += f" (rank 0's structure: {ref[0]}; rank {rank}'s: {sig[0]})"
        raise ValueError(f"fmp.distributed: the trees to reduce differ across ranks: {what}; "
                         "every rank must hold the same params (same names, shapes and "
                         "dtypes)")
    checked.add(key)


def _buckets(leaves: list[Any], cap_bytes: int) -> list[list[int]]:
    """Indices of the floating leaves, grouped by (device, dtype), each group split in
    buckets of at most ``cap_bytes`` (a larger tensor gets a bucket of its own)."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[int]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for i, x in enumerate(leaves):
        if not _is_float(x):
            continue
        k = (x.device, x.dtype)
        nbytes = x.numel() * x.element_size()
        if k not in groups or (sizes[k] + nbytes > cap_bytes and groups[k][-1]):
            groups.setdefault(k, []).append([])
            sizes[k] = 0
        groups[k][-1].append(i)
        sizes[k] += nbytes
    return [b for bs in groups.values() for b in bs]


def all_reduce_grads(
    grads: T,
    group: Any = None,
    op: Literal["mean", "sum"] = "mean",
    *,
    reduce_dtype: str | torch.dtype | None = None,
    bucket_mb: float = BUCKET_MB,
) -> T:
    """Sum or average the floating leaves of ``grads`` across the ranks of ``group``.

    Bucketed, as DDP: the floating leaves are grouped by (device, dtype) and packed into
    flat buffers of at most ``bucket_mb`` MB; one functional all-reduce runs per buffer,
    so a model of many small tensors costs few collectives. For ``"mean"`` each buffer is
    divided by the world size before the sum (as DDP's default hook, so low-precision
    grads do not overflow in the sum). The function is pure: the input tensors are not
    modified, a new tree is returned (leaves of one bucket are views of one fresh buffer).
    Non-floating leaves (and None, an empty subtree) pass through.

    Before the first reduction of a given tree signature it checks, once, that all ranks
    hold the same tree (:func:`check_same_tree`), so a mismatch raises instead of hanging.

    Args:
        grads: a pytree of gradients, identical in structure, shapes and dtypes on every
            rank. Not for DTensor (FSDP2) grads: FSDP2 reduces them itself.
        group: a ProcessGroup, None or ``"default"``.
        op: ``"mean"`` (data-parallel average) or ``"sum"``.
        reduce_dtype: reduce in this dtype (e.g. ``"f32"`` for bfloat16 grads) and cast the
            result back to each leaf's dtype; None reduces in the leaves' own dtype.
        bucket_mb: the largest bucket, in MB (10**6 bytes), counted in the grads' dtype.

    Returns:
        A new tree of the same structure, each floating leaf of its input dtype and shape.

    Raises:
        ValueError: ``op`` is not ``"mean"``/``"sum"``, ``bucket_mb`` is not positive, or
            the trees differ across ranks (on every rank).
        TypeError: a leaf is a DTensor (FSDP2 already reduced it).
        RuntimeError: the group is not usable (see :func:`check_group`).

    Example:
        >>> # under torchrun, after torch.distributed.init_process_group("gloo"):
        >>> g = fmp.distributed.all_reduce_grads({"w": torch.ones(3)})  # doctest: +SKIP
    """
    return _all_reduce_grads(grads, group, op, reduce_dtype, bucket_mb, _CHECKED)


def _all_reduce_grads(grads: T, group: Any, op: str, reduce_dtype: str | torch.dtype | None,
                      bucket_mb: float, checked: set[tuple[Any, Any]]) -> T:
    """:func:`all_reduce_grads`, its tree check remembered in ``checked``."""
    if op not in ("mean", "sum"):
        raise ValueError(f"all_reduce_grads: op must be 'mean' or 'sum', got {op!r}")
    if not (isinstance(bucket_mb, int | float) and not isinstance(bucket_mb, bool)
            and bucket_mb > 0 and math.isfinite(bucket_mb)):
        raise ValueError(f"all_reduce_grads: bucket_mb must be a positive number, got "
                         f"{bucket_mb!r}")
    rdt = None if reduce_dtype is None else _dtype(reduce_dtype)
    pg = check_group(group)
    leaves, spec = optree.tree_flatten(grads)
    for i, x in enumerate(leaves):
        if is_dtensor(x):
            raise TypeError(f"all_reduce_grads: leaf {i} is a DTensor; FSDP2 (fully_shard) "
                            "already reduces its grads: check them with "
                            "fmp.distributed.all_finite, do not all-reduce them again")
    if not torch.compiler.is_compiling():
        _check_same_tree(grads, pg, checked)
    world = _dist().get_world_size(pg)
    out = list(leaves)
    if world == 1:
        return optree.tree_unflatten(spec, out)
    for bucket in _buckets(leaves, int(bucket_mb * 1e6)):
        ts = [leaves[i] for i in bucket]
        flat = torch.cat([t.reshape(-1) if rdt is None else t.reshape(-1).to(rdt) for t in ts])
        if op == "mean":
            flat = flat / world
        flat = _all_reduce(flat, "sum", pg)
        for i, t, piece in zip(bucket, ts, flat.split([t.numel() for t in ts]), strict=True):
            out[i] = piece.view(t.shape).to(t.dtype)
    return optree.tree_unflatten(spec, out)


def all_finite(tree: Any, group: Any = None) -> torch.Tensor:
    """Whether every floating leaf on every rank of ``group`` is free of inf and NaN.

    The local check (:func:`fmp.all_finite`) followed by one all-reduce (MIN) of a
    one-element flag: every rank gets the same verdict, so every rank skips together.
    DTensor leaves (FSDP2's sharded grads) are checked through their local shard
    (``.to_local()``), so each rank checks what it holds and the all-reduce combines the
    shards' verdicts. No host sync: the result is a tensor.

    Args:
        tree: any pytree (the trees may differ across ranks, e.g. shards); non-floating
            leaves are ignored. Every rank of ``group`` must call this.
        group: a ProcessGroup, None or ``"default"``.

    Returns:
        A 0-d bool tensor, the same on every rank, on the device of the leaves (the
        collective's device for a tree without floating leaves).

    Raises:
        RuntimeError: the group is not usable (see :func:`check_group`).

    Example:
        >>> ok = fmp.distributed.all_finite(grads)  # doctest: +SKIP
        >>> state = fmp.select_tree(ok, new_params, params)  # doctest: +SKIP
    """
    pg = check_group(group)
    leaves = [x.to_local() if is_dtensor(x) else x for x in optree.tree_leaves(tree)]
    local = _local_all_finite(leaves)
    if not any(_is_float(x) for x in leaves):
        backend = str(_dist().get_backend(pg))
        if "nccl" in backend and torch.cuda.is_available():
            local = local.to(torch.device("cuda", torch.cuda.current_device()))
    if _dist().get_world_size(pg) == 1:
        return local
    flag = _all_reduce(local.to(torch.float32).reshape(1), "min", pg)
    return flag.reshape(()) > 0


class GroupReducer:
    """A train step's data parallelism over a process group (an :class:`fmp.GradReducer`).

    ``reduce`` averages the grads across the group's ranks (:func:`all_reduce_grads`,
    bucketed); ``all_finite`` agrees on the finite verdict (:func:`all_finite`), so every
    rank skips together. The check that every rank reduces the same tree runs once per
    tree signature and reducer (its own record: two steps check for themselves).
    ``fmp.train_step(..., process_group=g)`` builds one.

    Args:
        group: a ``torch.distributed.ProcessGroup``, None or ``"default"`` (the default
            group).

    Raises:
        RuntimeError: the group is not usable (see :func:`check_group`).
        TypeError: ``group`` is neither a ProcessGroup, None nor ``"default"``.

    Example:
        >>> reducer = fmp.distributed.GroupReducer("default")  # doctest: +SKIP
        >>> step = fmp.train_step(loss_fn, opt, reducer=reducer)  # doctest: +SKIP
    """

    def __init__(self, group: Any = None) -> None:
        self.group = None if group == "default" else group
        check_group(self.group)
        self._checked: set[tuple[Any, Any]] = set()

    def reduce(self, grads: T) -> T:
        """``grads`` averaged across the ranks (:func:`all_reduce_grads` with ``"mean"``)."""
        return _all_reduce_grads(grads, self.group, "mean", None, BUCKET_MB, self._checked)

    def all_finite(self, grads: Any) -> torch.Tensor:
        """The finite verdict of every rank's grads, the same on each (:func:`all_finite`)."""
        return all_finite(grads, group=self.group)
