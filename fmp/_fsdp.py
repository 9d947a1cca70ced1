"""``fmp.distributed.fsdp_mixed_precision``: an fmp policy as FSDP2's mixed-precision policy."""

from __future__ import annotations

from typing import Any

import torch

from fmp.dtypes import dtype as _dtype
from fmp.policy import Policy, get_policy


def fsdp_mixed_precision(
    policy: str | Policy,
    reduce_dtype: str | torch.dtype | None = "float32",
    *,
    root: bool = True,
) -> Any:
    """An :class:`fmp.Policy` as FSDP2's ``MixedPrecisionPolicy`` for ``fully_shard``.

    FSDP2 keeps each sharded param in the dtype it has when ``fully_shard`` is called
    (cast the module to ``policy.param_dtype`` first), all-gathers it in its
    ``param_dtype`` for the forward and backward (fmp's compute dtype), reduce-scatters the
    grads in ``reduce_dtype`` and casts the module's outputs to ``output_dtype``.

    The mapping: ``param_dtype = policy.compute_dtype``, ``output_dtype =
    policy.output_dtype`` for the root (FSDP2 casts the outputs of *every* ``fully_shard``
    module to its ``output_dtype``, so inner modules get None with ``root=False`` and
    hand their outputs on in the compute dtype), ``cast_forward_inputs=True`` (floating
    inputs are cast to the compute dtype, as :func:`fmp.value_and_grad` does) and
    ``reduce_dtype`` float32 by
    default: a sum over many ranks in bfloat16/float16 rounds at every step of the
    reduction, and with float32 params (the ``*-mixed`` policies) the grads land in float32
    anyway. For a "true" low-precision policy (``bf16-true``) pass ``reduce_dtype=None``
    (FSDP2 then reduces in the compute dtype) to halve the gradient traffic.

    Args:
        policy: a :class:`fmp.Policy` or a spec for :func:`fmp.get_policy`.
        reduce_dtype: the dtype of the gradient reduce-scatter; None follows the compute
            dtype (FSDP2's default).
        root: the policy for the root ``fully_shard`` call (the model's outputs are cast
            to ``policy.output_dtype``); False for inner modules (``output_dtype=None``).

    Returns:
        A ``torch.distributed.fsdp.MixedPrecisionPolicy``: pass ``root=False``'s to the
        inner modules' ``fully_shard`` calls and the default one to the root's.

    Raises:
        ValueError: a bad policy spec or dtype.

    Example:
        >>> mp = fmp.distributed.fsdp_mixed_precision("bf16-mixed")
        >>> mp.param_dtype, mp.reduce_dtype, mp.output_dtype
        (torch.bfloat16, torch.float32, torch.float32)
        >>> for block in model.blocks:  # doctest: +SKIP
        ...     fully_shard(block, mp_policy=fmp.distributed.fsdp_mixed_precision(
        ...         "bf16-mixed", root=False))
        >>> fully_shard(model, mp_policy=mp)  # doctest: +SKIP
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    pol = get_policy(policy)
    return MixedPrecisionPolicy(
        param_dtype=pol.compute_dtype,
        reduce_dtype=None if reduce_dtype is None else _dtype(reduce_dtype),
        output_dtype=pol.output_dtype if root else None,
        cast_forward_inputs=True,
    )
