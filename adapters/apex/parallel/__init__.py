"""``apex.parallel``: Apex's data-parallel pieces, mapped onto torch.

- :class:`DistributedDataParallel`: torch's DDP with Apex's arguments
  (see :mod:`adapters.apex.parallel.distributed`); :class:`Reducer`;
- :class:`SyncBatchNorm`: ``torch.nn.SyncBatchNorm`` with Apex's arguments, also on CPU
  (gloo); :func:`convert_syncbn_model`, :func:`create_syncbn_process_group`;
- ``LARC`` (``from adapters.apex.parallel.LARC import LARC``, as in Apex).

Example:
    >>> from adapters.apex import parallel
    >>> net = parallel.convert_syncbn_model(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    >>> isinstance(net[0], torch.nn.SyncBatchNorm)
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from adapters.apex.parallel.distributed import DistributedDataParallel, Reducer
from adapters.apex.parallel.LARC import LARC
from adapters.apex.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["LARC", "DistributedDataParallel", "ReduceOp", "Reducer", "SyncBatchNorm",
           "convert_syncbn_model", "create_syncbn_process_group"]

ReduceOp = dist.ReduceOp


def convert_syncbn_model(module: torch.nn.Module, process_group: Any = None,
                         channel_last: bool = False) -> torch.nn.Module:
    """Replace every batch norm of ``module`` by a :class:`SyncBatchNorm`.

    Each keeps the batch norm's hyper-parameters, running statistics (the same buffers,
    as Apex), ``num_batches_tracked``, affine params (copied), training mode, device and
    dtype.

    Args:
        module: a model, or a batch norm.
        process_group: the group the statistics are reduced over (None: the world).
        channel_last: the new layers take channels-last input.

    Returns:
        The converted module (``module`` itself unless it is a batch norm).

    Example:
        >>> bn = convert_syncbn_model(torch.nn.BatchNorm1d(4, momentum=0.3))
        >>> type(bn).__name__, bn.momentum
        ('SyncBatchNorm', 0.3)
    """
    mod = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            channel_last=channel_last)
        if module.track_running_stats:
            mod.running_mean = module.running_mean
            mod.running_var = module.running_var
            mod.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                mod.weight = torch.nn.Parameter(module.weight.detach().clone(),
                                                requires_grad=module.weight.requires_grad)
                mod.bias = torch.nn.Parameter(module.bias.detach().clone(),
                                              requires_grad=module.bias.requires_grad)
        mod.train(module.training)
    for name, child in module.named_children():
        mod.add_module(name, convert_syncbn_model(child, process_group=process_group,
                                                  channel_last=channel_last))
    return mod


def create_syncbn_process_group(group_size: int) -> Any:
    """Split the world into groups of ``group_size`` consecutive ranks for sync BN.

    Every rank must call it (each group is created on all ranks).

    Args:
        group_size: ranks per group; 0 means the whole world.

    Returns:
        This rank's group, or None for ``group_size=0``.

    Raises:
        ValueError: ``group_size`` does not divide the world size.
    """
    if group_size == 0:
        return None
    world = dist.get_world_size()
    if group_size < 1 or world % group_size:
        raise ValueError(f"create_syncbn_process_group: group_size must divide the world "
                         f"size {world}, got {group_size}")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if dist.get_rank() // group_size == start // group_size:
            mine = group
    return mine
