"""``amp_C``: Apex's multi-tensor CUDA kernels, rebuilt on ``torch._foreach_*`` ops.

Each kernel takes ``(chunk_size, noop_flag, tensor_lists, *args)`` like Apex's and is meant
to be called through :data:`adapters.apex.multi_tensor_apply.multi_tensor_applier`.
``noop_flag`` is a one-element int tensor (Apex's "overflow buffer"): a kernel that checks
its inputs sets it to 1 when it meets an inf or NaN and never resets it. Nothing here
copies to the host, so the kernels run on CPU and CUDA alike and under CUDA graphs.
``chunk_size`` is accepted and unused (torch picks its own launch shape).

Kernels: :func:`multi_tensor_scale`, :func:`multi_tensor_l2norm`, :func:`multi_tensor_axpby`,
:func:`multi_tensor_adam`, :func:`multi_tensor_sgd`, :func:`update_scale_hysteresis`,
:func:`multi_tensor_unscale_l2norm`.

Example:
    >>> from adapters.apex import amp_C
    >>> from adapters.apex.multi_tensor_apply import multi_tensor_applier
    >>> flag = torch.zeros(1, dtype=torch.int)
    >>> src, dst = [torch.tensor([1.0, float("inf")])], [torch.empty(2)]
    >>> multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.5)
    >>> int(flag)
    1
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from adapters.apex._scale_check_overflow import scale_check_overflow

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "scale_check_overflow",
    "update_scale_hysteresis",
]

Lists = Sequence[Sequence[torch.Tensor]]


def _check_lists(name: str, tensor_lists: Lists, n: int | tuple[int, ...]) -> None:
    ns = (n,) if isinstance(n, int) else n
    if len(tensor_lists) not in ns:
        raise ValueError(f"amp_C.{name}: tensor_lists must hold {' or '.join(map(str, ns))} "
                         f"lists of tensors, got {len(tensor_lists)}")
    lengths = {len(t) for t in tensor_lists}
    if len(lengths) > 1:
        raise ValueError(f"amp_C.{name}: the lists of tensor_lists differ in length "
                         f"({sorted(lengths)}); each must hold one tensor per position")


def _nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor: does any element of ``tensors`` hold an inf or NaN (no sync)."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool)
    # the max-abs norm of finite values is finite (no overflow), of inf/NaN is inf/NaN
    norms = torch._foreach_norm(list(tensors), math.inf)
    return ~torch.isfinite(torch.stack([n.float() for n in norms])).all()


def _raise_flag(noop_flag: torch.Tensor, bad: torch.Tensor) -> None:
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                       scale: float) -> None:
    """``out = in * scale`` for ``tensor_lists = [ins, outs]``; flags an inf/NaN in ``ins``.

    The outputs are written even when the flag is set (Apex propagates infs), cast to each
    output's dtype (fp16 model grads into fp32 master grads, for example).

    Args:
        chunk_size: unused.
        noop_flag: one-element int tensor, set to 1 if an input holds an inf or NaN.
        tensor_lists: ``[ins, outs]``, equal-length lists of equal-shape tensors.
        scale: the factor.

    Raises:
        ValueError: ``tensor_lists`` is not two lists of one length.

    Example:
        >>> flag = torch.zeros(1, dtype=torch.int)
        >>> out = [torch.empty(2)]
        >>> multi_tensor_scale(0, flag, [[torch.ones(2)], out], 4.0); out[0].tolist()
        [4.0, 4.0]
    """
    _check_lists("multi_tensor_scale", tensor_lists, 2)
    ins, outs = list(tensor_lists[0]), list(tensor_lists[1])
    if not ins:
        return
    _raise_flag(noop_flag, _nonfinite(ins))
    scaled = torch._foreach_mul([t.float() for t in ins], float(scale))
    for o, s in zip(outs, scaled, strict=True):
        o.copy_(s)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                        per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all tensors of ``tensor_lists[0]`` together, and of each one.

    Computed in float32 whatever the tensors' dtype; a non-finite norm sets the flag.

    Args:
        chunk_size: unused.
        noop_flag: one-element int tensor, set to 1 if a norm is inf or NaN.
        tensor_lists: ``[tensors]``.
        per_tensor: also return each tensor's norm.

    Returns:
        ``(total, per)``: ``total`` a float32 tensor of shape ``[1]``; ``per`` of shape
        ``[len(tensors)]`` when ``per_tensor`` else of shape ``[0]``.

    Raises:
        ValueError: ``tensor_lists`` is not one non-empty list.

    Example:
        >>> flag = torch.zeros(1, dtype=torch.int)
        >>> total, per = multi_tensor_l2norm(0, flag, [[torch.tensor([3.0, 4.0])]], True)
        >>> total.tolist(), per.tolist()
        ([5.0], [5.0])
    """
    _check_lists("multi_tensor_l2norm", tensor_lists, 1)
    ts = list(tensor_lists[0])
    if not ts:
        raise ValueError("amp_C.multi_tensor_l2norm: tensor_lists[0] is empty")
    per = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts])
    total = per.square().sum().sqrt().reshape(1)
    _raise_flag(noop_flag, ~torch.isfinite(per).all() | ~torch.isfinite(total[0]))
    return total, (per if per_tensor else per.new_empty(0))


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                                inv_scale: torch.Tensor | float, per_tensor: bool | None = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`multi_tensor_l2norm` of ``t * inv_scale``; the tensors are not written (as Apex).

    Each element is widened to float32 and multiplied by ``inv_scale`` before it is squared,
    so scaled float16 grads whose squares would overflow still give the right norm.

    Args:
        chunk_size: unused.
        noop_flag: one-element int tensor, set to 1 if a norm is inf or NaN.
        tensor_lists: ``[tensors]``.
        inv_scale: ``1 / loss_scale``: a one-element float32 tensor (as Apex takes it) or a
            number.
        per_tensor: also return each tensor's unscaled norm.

    Returns:
        ``(total, per)`` as :func:`multi_tensor_l2norm`.

    Raises:
        ValueError: ``tensor_lists`` is not one non-empty list, or ``inv_scale`` is a tensor
            with other than one element.

    Example:
        >>> flag, g = torch.zeros(1, dtype=torch.int), [torch.tensor([6.0, 8.0])]
        >>> total, per = multi_tensor_unscale_l2norm(0, flag, [g], torch.tensor([0.5]), True)
        >>> total.tolist(), per.tolist(), g[0].tolist()
        ([5.0], [5.0], [6.0, 8.0])
    """
    _check_lists("multi_tensor_unscale_l2norm", tensor_lists, 1)
    ts = list(tensor_lists[0])
    if not ts:
        raise ValueError("amp_C.multi_tensor_unscale_l2norm: tensor_lists[0] is empty")
    if isinstance(inv_scale, torch.Tensor):
        if inv_scale.numel() != 1:
            raise ValueError(f"amp_C.multi_tensor_unscale_l2norm: inv_scale must hold one "
                             f"element, got shape {tuple(inv_scale.shape)}")
        inv = inv_scale.reshape(()).to(device=ts[0].device, dtype=torch.float32)
    else:
        inv = torch.tensor(float(inv_scale), dtype=torch.float32, device=ts[0].device)
    unscaled = torch._foreach_mul([t.float() for t in ts], inv)
    return multi_tensor_l2norm(chunk_size, noop_flag, [unscaled], per_tensor)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                       a: float, b: float, arg_to_check: int) -> None:
    """``out = a * x + b * y`` for ``tensor_lists = [xs, ys, outs]``.

    Args:
        chunk_size: unused.
        noop_flag: one-element int tensor, set to 1 on an inf/NaN in the checked inputs.
        tensor_lists: ``[xs, ys, outs]``.
        a: factor of ``x``.
        b: factor of ``y``.
        arg_to_check: ``-1`` check ``x`` and ``y``, ``0`` only ``x``, ``1`` only ``y``.

    Raises:
        ValueError: bad ``tensor_lists`` or ``arg_to_check``.

    Example:
        >>> flag, out = torch.zeros(1, dtype=torch.int), [torch.empty(1)]
        >>> multi_tensor_axpby(0, flag, [[torch.ones(1)], [torch.ones(1)], out], 2.0, 3.0, -1)
        >>> out[0].item()
        5.0
    """
    _check_lists("multi_tensor_axpby", tensor_lists, 3)
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"amp_C.multi_tensor_axpby: arg_to_check must be -1, 0 or 1, "
                         f"got {arg_to_check!r}")
    xs, ys, outs = (list(t) for t in tensor_lists)
    if not xs:
        return
    checked = (xs if arg_to_check in (-1, 0) else []) + (ys if arg_to_check in (-1, 1) else [])
    _raise_flag(noop_flag, _nonfinite(checked))
    res = torch._foreach_mul([x.float() for x in xs], float(a))
    torch._foreach_add_(res, [y.float() for y in ys], alpha=float(b))
    for o, r in zip(outs, res, strict=True):
        o.copy_(r)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                      lr: float, beta1: float, beta2: float, epsilon: float, step: int,
                      mode: int, bias_correction: int, weight_decay: float) -> None:
    """One Adam step in place on ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``.

    ``mode=0``: L2 (``g + weight_decay * p`` enters the moments); ``mode=1``: decoupled
    (AdamW: ``weight_decay * p`` is added to the update). Math in float32; like Apex's
    kernel it does not read ``noop_flag`` (amp skips the whole step instead).

    Raises:
        ValueError: bad ``tensor_lists`` or ``mode``.

    Example:
        >>> p, g = torch.ones(2), torch.full((2,), 0.5)
        >>> m, v = torch.zeros(2), torch.zeros(2)
        >>> multi_tensor_adam(0, torch.zeros(1, dtype=torch.int), [[g], [p], [m], [v]],
        ...                   0.1, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
        >>> round(p[0].item(), 4)
        0.9
    """
    _check_lists("multi_tensor_adam", tensor_lists, 4)
    if mode not in (0, 1):
        raise ValueError(f"amp_C.multi_tensor_adam: mode must be 0 (L2) or 1 (AdamW), "
                         f"got {mode!r}")
    gs, ps, ms, vs = (list(t) for t in tensor_lists)
    if not gs:
        return
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    g32 = [g.float() for g in gs]
    p32 = [p.float() for p in ps]
    m32 = [m.float() for m in ms]
    v32 = [v.float() for v in vs]
    if mode == 0 and weight_decay != 0:
        g32 = torch._foreach_add(g32, p32, alpha=weight_decay)
    torch._foreach_lerp_(m32, g32, 1.0 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, value=1.0 - beta2)
    denom = torch._foreach_sqrt(torch._foreach_div(v32, bc2))
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(torch._foreach_div(m32, bc1), denom)
    if mode == 1 and weight_decay != 0:
        torch._foreach_add_(update, p32, alpha=weight_decay)
    torch._foreach_add_(p32, update, alpha=-lr)
    for dst, src in zip(ps + ms + vs, p32 + m32 + v32, strict=True):
        if dst is not src:
            dst.copy_(src)


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Lists,
                     wd: float, momentum: float, dampening: float, lr: float,
                     nesterov: bool, first_run: bool, wd_after_momentum: bool,
                     scale: float = 1.0) -> None:
    """One SGD step in place on ``[grads, params, momenta]`` (+ ``[fp16 copies]``).

    As Apex's kernel: nothing changes when ``noop_flag`` is already set; grads are
    multiplied by ``scale`` first; ``first_run`` sets the momentum to the grad; weight
    decay goes before momentum unless ``wd_after_momentum``; a 4th list receives a
    float16 copy of the new params. Math in float32.

    Raises:
        ValueError: bad ``tensor_lists``.

    Example:
        >>> p, g, m = torch.ones(1), torch.ones(1), torch.zeros(1)
        >>> multi_tensor_sgd(0, torch.zeros(1, dtype=torch.int), [[g], [p], [m]],
        ...                  0.0, 0.9, 0.0, 0.1, False, True, False, 1.0)
        >>> round(p.item(), 4), m.item()
        (0.9, 1.0)
    """
    _check_lists("multi_tensor_sgd", tensor_lists, (3, 4))
    gs, ps, ms = (list(t) for t in tensor_lists[:3])
    copies = list(tensor_lists[3]) if len(tensor_lists) == 4 else []
    if not gs:
        return
    skip = (noop_flag != 0).reshape(())
    g32 = torch._foreach_mul([g.float() for g in gs], float(scale))
    p32 = [p.float() for p in ps]
    if wd != 0 and not wd_after_momentum:
        torch._foreach_add_(g32, p32, alpha=wd)
    new_m = None
    if momentum != 0:
        if first_run:
            new_m = [g.clone() for g in g32]
        else:
            new_m = torch._foreach_mul([m.float() for m in ms], momentum)
            torch._foreach_add_(new_m, g32, alpha=1.0 - dampening)
        if nesterov:
            torch._foreach_add_(g32, new_m, alpha=momentum)
        else:
            g32 = [m.clone() for m in new_m]
    if wd != 0 and wd_after_momentum:
        torch._foreach_add_(g32, p32, alpha=wd)
    new_p = torch._foreach_add(p32, g32, alpha=-lr)
    for p, n in zip(ps, new_p, strict=True):
        p.copy_(torch.where(skip, p, n.to(p.dtype)))
    for c, p in zip(copies, ps if copies else [], strict=True):
        c.copy_(torch.where(skip, c, p.to(c.dtype)))
    if new_m is not None:
        for m, n in zip(ms, new_m, strict=True):
            m.copy_(torch.where(skip, m, n.to(m.dtype)))


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor,
                            growth_factor: float, backoff_factor: float,
                            growth_interval: int, hysteresis: int) -> torch.Tensor:
    """Update a dynamic loss scale in place, backing off only after ``hysteresis`` infs.

    As Apex's kernel: on an inf the hysteresis tracker drops by one; while it stays
    above 0 only the growth tracker is reset. Once it reaches 0, the scale is multiplied
    by ``backoff_factor``. After a clean step the growth tracker counts up, and at
    ``growth_interval`` the scale grows by ``growth_factor`` (unless that overflows float32)
    and the hysteresis tracker is refilled to ``hysteresis``. A backed-off scale below the
    smallest normal float32 becomes 0 (Apex's kernel flushes subnormals). No host sync.

    Args:
        current_scale: one-element float32 tensor, updated in place.
        growth_tracker: one-element int32 tensor, updated in place.
        hysteresis_tracker: one-element int32 tensor, updated in place.
        found_inf: one-element float tensor, > 0 after an overflow.
        growth_factor: the growth factor, e.g. 2.0.
        backoff_factor: the back-off factor, e.g. 0.5.
        growth_interval: clean steps before growing.
        hysteresis: infs tolerated before backing off.

    Returns:
        ``current_scale``.

    Example:
        >>> s, g, h = torch.tensor([8.0]), torch.tensor([0], dtype=torch.int32), \\
        ...     torch.tensor([2], dtype=torch.int32)
        >>> _ = update_scale_hysteresis(s, g, h, torch.tensor([1.0]), 2.0, 0.5, 10, 2)
        >>> s.item(), h.item()
        (8.0, 1)
    """
    inf = found_inf.reshape(()) > 0
    any_inf = found_inf.reshape(()) != 0
    h = hysteresis_tracker.reshape(())
    h_new = torch.where(inf, h - 1, h)
    hold = inf & (h_new > 0)  # tolerated: only the growth tracker resets
    backoff = any_inf & ~hold
    clean = ~any_inf
    scale = current_scale.reshape(()).float()
    successful = growth_tracker.reshape(()) + 1
    grow = clean & (successful == growth_interval)
    grown = (scale * growth_factor).float()
    backed = scale * backoff_factor  # Apex's kernel is built with fast math: subnormals flush
    backed = torch.where(backed.abs() < torch.finfo(torch.float32).tiny,
                         torch.zeros_like(backed), backed)
    new_scale = torch.where(backoff, backed,
                            torch.where(grow & torch.isfinite(grown), grown, scale))
    new_growth = torch.where(clean & ~grow, successful, torch.zeros_like(successful))
    new_h = torch.where(found_inf.reshape(()) <= 0, torch.full_like(h, hysteresis), h_new)
    current_scale.copy_(new_scale.reshape(current_scale.shape).to(current_scale.dtype))
    growth_tracker.copy_(new_growth.reshape(growth_tracker.shape).to(growth_tracker.dtype))
    hysteresis_tracker.copy_(new_h.reshape(hysteresis_tracker.shape)
                             .to(hysteresis_tracker.dtype))
    return current_scale
