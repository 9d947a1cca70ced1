"""``apex.parallel.SyncBatchNorm`` on ``torch.nn.SyncBatchNorm``, on CPU (gloo) too.

On CUDA the statistics are reduced by torch's ``SyncBatchNorm``. torch refuses CPU
inputs when it has to synchronise; there the per-channel sums are all-reduced here by a
differentiable sum over the group (two passes: the mean, then the centred squares),
which gives the same values and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SyncBatchNorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the grad of each rank's input is the sum of the output grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)

_TORCH_SYNC_DEVICES = ("cuda", "hpu", "xpu")


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Batch norm whose training statistics cover the whole process group.

    A ``torch.nn.SyncBatchNorm`` with Apex's arguments: ``channel_last=True`` takes
    channels-last input (channels in the last dim); ``fuse_relu=True`` applies a ReLU
    after the (optional) residual ``z`` of ``forward(input, z)``, as Apex's fused kernel.
    In eval mode it is a plain batch norm on the running statistics.

    Args:
        num_features: channels.
        eps: added to the variance (1e-5).
        momentum: running-statistics momentum (0.1; None: cumulative average).
        affine: learnable weight and bias (True).
        track_running_stats: keep running statistics (True).
        process_group: the group to reduce over (None: the world).
        channel_last: channels in the last dim (False).
        fuse_relu: ReLU after the addition of ``z`` (False).

    Example:
        >>> bn = SyncBatchNorm(3)
        >>> bn(torch.randn(4, 3, 5)).shape  # one process: a plain batch norm
        torch.Size([4, 3, 5])
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, process_group=process_group)
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group: Any) -> None:
        self.process_group = process_group

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        x = input.movedim(-1, 1) if self.channel_last else input
        out = self._normalize(x)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return torch.relu(out) if self.fuse_relu else out

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        sync = self.training and self._group_size() > 1
        if not sync or x.device.type in _TORCH_SYNC_DEVICES:
            return super().forward(x)
        return self._cpu_sync(x)

    def _cpu_sync(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        group = self.process_group or dist.group.WORLD
        dtype = self.weight.dtype if self.weight is not None else (
            self.running_mean.dtype if self.running_mean is not None else x.dtype)
        xc = x.to(dtype)
        c = xc.shape[1]
        dims = [0, *range(2, xc.dim())]
        count = torch.tensor([xc.numel() / c], dtype=dtype)
        total = all_reduce(torch.cat([xc.sum(dims), count]), group=group)
        n = total[c]
        mean = total[:c] / n
        shape = [1, c] + [1] * (xc.dim() - 2)
        centred = xc - mean.reshape(shape)
        var = all_reduce(centred.square().sum(dims), group=group) / n  # biased, as BN
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                     else self.momentum)
                self.running_mean.mul_(1 - m).add_(mean.detach() * m)
                unbiased = var.detach() * (n / (n - 1)).detach()
                self.running_var.mul_(1 - m).add_(unbiased * m)
        return out.to(x.dtype)

