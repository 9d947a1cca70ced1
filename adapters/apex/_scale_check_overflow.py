"""``amp_C.scale_check_overflow``: Apex's early fused unscale-and-check of one tensor."""

from __future__ import annotations

import torch


def scale_check_overflow(input: torch.Tensor, scale: float, overflow_buf: torch.Tensor,
                         output: torch.Tensor) -> None:
    """Write ``input * scale`` into ``output``; set ``overflow_buf`` to 1 if ``input`` has
    an inf or NaN (it is left alone otherwise, so one buffer collects several calls).

    As Apex's kernel, the output must be float32 (float16 input is widened); ``input`` and
    ``output`` may be the same tensor. No host sync.

    Args:
        input: the scaled gradient, float16 or float32.
        scale: the factor, e.g. ``1 / loss_scale``.
        overflow_buf: a one-element int tensor, raised to 1 on a non-finite value.
        output: a float32 tensor with ``input``'s number of elements.

    Raises:
        ValueError: ``output`` is not float32, or the sizes differ.

    Example:
        >>> buf = torch.zeros(1, dtype=torch.int)
        >>> out = torch.empty(2)
        >>> scale_check_overflow(torch.tensor([2.0, float("inf")]), 0.5, buf, out)
        >>> out[0].item(), buf.item()
        (1.0, 1)
    """
    if output.dtype != torch.float32:
        raise ValueError(f"amp_C.scale_check_overflow: output must be float32 (as in Apex), "
                         f"got {output.dtype}")
    if output.numel() != input.numel():
        raise ValueError(f"amp_C.scale_check_overflow: input has {input.numel()} elements, "
                         f"output {output.numel()}")
    bad = (~torch.isfinite(input)).any()
    torch.mul(input.reshape(output.shape).float(), scale, out=output)
    overflow_buf.copy_(torch.where(bad, torch.ones_like(overflow_buf), overflow_buf))
