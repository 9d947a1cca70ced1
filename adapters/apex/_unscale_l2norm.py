"""``amp_C.multi_tensor_unscale_l2norm``: the L2 norm of unscaled grads, grads left as they are."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor,
                                tensor_lists: Sequence[Sequence[torch.Tensor]],
                                inv_scale: torch.Tensor | float,
                                per_tensor: bool | None = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of ``t * inv_scale`` over all tensors of ``tensor_lists[0]``, and per tensor.

    As Apex's kernel, the unscaling is done only for the norm: the tensors are not written.
    Each element is widened to float32 and multiplied by ``inv_scale`` before it is squared,
    so scaled float16 grads whose squares would overflow still give the right norm. A
    non-finite norm sets ``noop_flag`` to 1 (it is never reset). No host sync.

    Args:
        chunk_size: unused (torch picks its own launch shape).
        noop_flag: one-element int tensor, set to 1 when a norm is inf or NaN.
        tensor_lists: ``[tensors]``, one non-empty list of floating tensors.
        inv_scale: ``1 / loss_scale``: a one-element float32 tensor (as Apex takes it) or a
            number.
        per_tensor: also return each tensor's unscaled norm.

    Returns:
        ``(total, per)``: ``total`` a float32 tensor of shape ``[1]``; ``per`` of shape
        ``[len(tensors)]`` when ``per_tensor`` else of shape ``[0]``.

    Raises:
        ValueError: ``tensor_lists`` is not one non-empty list, or ``inv_scale`` is a tensor
            with other than one element.

    Example:
        >>> flag = torch.zeros(1, dtype=torch.int)
        >>> g = [torch.tensor([6.0, 8.0])]
        >>> total, per = multi_tensor_unscale_l2norm(0, flag, [g], torch.tensor([0.5]), True)
        >>> total.tolist(), per.tolist(), g[0].tolist()
        ([5.0], [5.0], [6.0, 8.0])
    """
    name = "amp_C.multi_tensor_unscale_l2norm"
    if len(tensor_lists) != 1:
        raise ValueError(f"{name}: tensor_lists must hold 1 list of tensors, got "
                         f"{len(tensor_lists)}")
    ts = list(tensor_lists[0])
    if not ts:
        raise ValueError(f"{name}: tensor_lists[0] is empty")
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.numel() != 1:
            raise ValueError(f"{name}: inv_scale must hold one element, got shape "
                             f"{tuple(inv_scale.shape)}")
        inv = inv_scale.reshape(()).to(device=ts[0].device, dtype=torch.float32)
    else:
        inv = torch.tensor(float(inv_scale), dtype=torch.float32, device=ts[0].device)
    unscaled = torch._foreach_mul([t.float() for t in ts], inv)
    per = torch.stack([n.float() for n in torch._foreach_norm(unscaled, 2)])
    total = per.square().sum().sqrt().reshape(1)
    bad = ~torch.isfinite(per).all() | ~torch.isfinite(total[0])
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)
    return total, (per if per_tensor else per.new_empty(0))
