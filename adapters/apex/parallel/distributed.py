"""``apex.parallel.DistributedDataParallel`` and ``Reducer`` on torch's DDP and collectives.

Apex's arguments map onto ``torch.nn.parallel.DistributedDataParallel``:

- ``message_size`` (elements per bucket) -> ``bucket_cap_mb = message_size * 4 / 2**20``;
- ``delay_allreduce=True`` -> one bucket for all params, so the all-reduce waits for the
  whole backward pass, as Apex's;
- ``gradient_average``, ``gradient_predivide_factor``, ``allreduce_always_fp32`` -> a DDP
  comm hook that divides by the factor, all-reduces (in float32 if asked), then
  multiplies by ``factor / world_size`` (or not, without averaging), as Apex did;
- ``shared_param`` raises, as Apex; the arguments about Apex's own streams and buffers
  (``allreduce_trigger_params``, ``retain_allreduce_buffers``, ``num_allreduce_streams``,
  ``allreduce_communicators``, ``prof``) warn and have no effect.

Buffers are not broadcast on each forward (``forward_sync_buffers=False``, or
``broadcast_buffers=False`` before torch 2.13): Apex's DDP only broadcast the params.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from adapters.apex._warn import warn_unsupported

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

_BYTES_PER_ELEMENT = 4
# torch >= 2.13 renamed broadcast_buffers (which still works, with a FutureWarning)
_NO_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                   else "broadcast_buffers")


def _comm_hook(group: Any, average: bool, predivide: float, fp32: bool):
    def hook(state, bucket):  # no annotations: torch checks them, and they are strings here
        buf = bucket.buffer()
        t = buf.float() if fp32 and buf.dtype != torch.float32 else buf
        if predivide != 1.0:
            t.div_(predivide)
        fut = dist.all_reduce(t, group=group, async_op=True).get_future()

        def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
            out = f.value()[0]
            if average:
                out.mul_(predivide / dist.get_world_size(group))
            if out is not buf:
                buf.copy_(out)
            return buf

        return fut.then(finish)

    return hook


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Apex's DistributedDataParallel, as a ``torch.nn.parallel.DistributedDataParallel``.

    Wrap the model after ``amp.initialize`` (Apex's order). The grads are averaged over
    the ranks during backward, so an inf/NaN on one rank reaches every rank and amp
    skips the step everywhere.

    Args:
        module: the model (on this rank's device, or on CPU with gloo).
        message_size: elements per communication bucket (1e7).
        delay_allreduce: all-reduce only once the backward pass is over (False).
        shared_param: removed in Apex; must be None.
        allreduce_trigger_params: warns; buckets are cut by size instead.
        retain_allreduce_buffers: warns; no flat buffers are kept.
        allreduce_always_fp32: all-reduce float16 grads in float32 (False).
        num_allreduce_streams: warns unless 1; torch DDP uses its own stream.
        allreduce_communicators: warns; torch DDP uses the default group.
        gradient_average: divide the sum by the world size (True).
        gradient_predivide_factor: divide before the all-reduce, multiply back after (1.0).
        gradient_average_split_factor: Apex's old name of ``gradient_predivide_factor``.
        prof: warns; no NVTX ranges are pushed.
        **ddp_kwargs: passed to torch's DDP (``device_ids``, ``process_group``, ...).

    Raises:
        ValueError: ``shared_param`` given, or ``allreduce_trigger_params`` or
            ``num_allreduce_streams > 1`` with ``delay_allreduce``.

    Example:
        >>> DistributedDataParallel.__mro__[1] is torch.nn.parallel.DistributedDataParallel
        True
    """

    def __init__(self, module: torch.nn.Module, message_size: int = 10000000,
                 delay_allreduce: bool = False, shared_param: Any = None,
                 allreduce_trigger_params: Any = None, retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False, num_allreduce_streams: int = 1,
                 allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: float | None = None, prof: bool = False,
                 **ddp_kwargs: Any) -> None:
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported (as in Apex); "
                             "use delay_allreduce=True|False instead")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("allreduce_trigger_params is only valid with "
                             "delay_allreduce=False")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 is only valid with "
                             "delay_allreduce=False")
        name = "apex.parallel.DistributedDataParallel"
        if allreduce_trigger_params is not None:
            warn_unsupported(name, "allreduce_trigger_params", "[...]",
                             "ignored; torch DDP cuts its buckets by message_size")
        if retain_allreduce_buffers:
            warn_unsupported(name, "retain_allreduce_buffers", True,
                             "ignored; the reduced grads are in each param's .grad only")
        if num_allreduce_streams != 1:
            warn_unsupported(name, "num_allreduce_streams", num_allreduce_streams,
                             "ignored; torch DDP all-reduces on its own stream")
        if allreduce_communicators is not None:
            warn_unsupported(name, "allreduce_communicators", "(...)",
                             "ignored; torch DDP uses its process group")
        if prof:
            warn_unsupported(name, "prof", True, "ignored; no NVTX ranges are pushed")
        if gradient_average_split_factor is not None:
            warn_unsupported(name, "gradient_average_split_factor",
                             gradient_average_split_factor,
                             "it is Apex's old name: used as gradient_predivide_factor")
            gradient_predivide_factor = gradient_average_split_factor
        if delay_allreduce:
            numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
            bucket_mb = max(1.0, 2.0 * numel * 8 / 2**20)
        else:
            bucket_mb = message_size * _BYTES_PER_ELEMENT / 2**20
        if not ({"broadcast_buffers", "forward_sync_buffers"} & ddp_kwargs.keys()):
            ddp_kwargs[_NO_BUFFER_SYNC] = False
        super().__init__(module, bucket_cap_mb=bucket_mb, **ddp_kwargs)
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.world_size = float(dist.get_world_size(self.process_group))
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            self.register_comm_hook(None, _comm_hook(self.process_group, gradient_average,
                                                     self.gradient_predivide_factor,
                                                     allreduce_always_fp32))

    def _passing_sync_batchnorm_handle(self, module: torch.nn.Module) -> None:
        # torch refuses SyncBatchNorm in a CPU module; ours synchronises on CPU (gloo)
        from adapters.apex.parallel.sync_batchnorm import SyncBatchNorm

        others = [m for m in module.modules()
                  if isinstance(m, torch.nn.SyncBatchNorm) and not isinstance(m, SyncBatchNorm)]
        if others or self.device_type != "cpu":
            super()._passing_sync_batchnorm_handle(module)

    def disable_allreduce(self) -> None:
        """Stop all-reducing grads (they accumulate locally) until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """All-reduce grads again from the next backward on."""
        self.require_backward_grad_sync = True


def flat_dist_call(tensors: list[torch.Tensor], call: Any, extra_args: tuple = ()) -> None:
    """Apply ``call`` (``dist.all_reduce`` or ``dist.broadcast``) to ``tensors`` flattened
    per dtype; an all-reduce is averaged over the world, as Apex's helper."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        call(flat, *extra_args)
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        with torch.no_grad():
            for t, new in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(new)


class Reducer:
    """Apex's Reducer: average grads over the ranks when :meth:`reduce` is called.

    Args:
        module_or_grads_list: a module (its params are broadcast from rank 0 now and
            its grads averaged by :meth:`reduce`), or a list of grad tensors.

    Example:
        >>> callable(Reducer.reduce)
        True
    """

    def __init__(self, module_or_grads_list: torch.nn.Module | list[torch.Tensor]) -> None:
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module: torch.nn.Module | None = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
            self.grads: list[torch.Tensor] = []
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        """All-reduce and average the grads."""
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)
