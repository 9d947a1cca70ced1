"""Loss scales: immutable records that scale losses, unscale gradients and adjust themselves.

Three frozen dataclasses share one interface:

- :class:`NoOpLossScale`: scale 1, every method is the identity.
- :class:`StaticLossScale`: a fixed scale.
- :class:`DynamicLossScale`: grows after ``period`` clean steps, shrinks on overflow.

Each record is a plain frozen dataclass whose fields are its one field table
(:mod:`fmp._records`): the record is a pytree node, registered from that table with
optree (in the global namespace, so plain ``optree.tree_map`` sees inside) and with
torch's pytree (so ``torch.func`` transforms and ``torch.compile(fullgraph=True)`` see
inside). The leaves are only the tensors that change
from step to step; the hyper-parameters (``period``, ``factor``, ``min_scale``,
``max_scale``, ``hysteresis``) are Python numbers carried in the flatten context, so they
survive every flatten/unflatten, transform and compilation unchanged (jmp loses its
``min_loss_scale`` under ``jit``: not here).

The scale is always a 0-d float32 tensor, whatever the compute dtype, and ``adjust`` is
branch-free (``torch.where``): it never synchronises the host.

The default :class:`DynamicLossScale` (``hysteresis=1``) follows the trajectory of
``torch.amp.GradScaler`` (``torch._amp_update_scale_``) step by step: the growth and the
back-off are computed like torch's kernel does, as the float32 scale times a double
factor rounded once to float32, so the values agree bit for bit for any ``factor``. The
only differences are the bounds: growth is capped at ``max_scale`` (torch instead keeps
the old scale when the grown one would be inf) and the back-off is floored at
``min_scale`` (torch has no floor).

Every record also owns the unscaling of the grads it scaled (:mod:`fmp.loss_scale._unscale`):
``unscale``, ``unscale_and_check`` (pure or one in-place pass), ``unscale_for_fused`` (for
torch's fused optimizer kernels) and ``unscale_and_check_`` (``GradScaler.unscale_``'s
contract).

The package: ``_validate`` (checks of Python values), ``_scaling`` (the arithmetic),
``_inplace`` (torch's amp kernel), ``_unscale`` (the unscale methods), one module per record
(``_noop``, ``_static``, ``_dynamic``), and here the state-dict dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fmp.loss_scale._dynamic import DynamicLossScale
from fmp.loss_scale._noop import NoOpLossScale
from fmp.loss_scale._static import StaticLossScale

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "loss_scale_from_state_dict",
]

#: Any of the three loss-scale records (for annotations).
LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

_CLASSES: dict[str, type[NoOpLossScale] | type[StaticLossScale] | type[DynamicLossScale]] = {
    c.__name__: c for c in (NoOpLossScale, StaticLossScale, DynamicLossScale)
}


def loss_scale_from_state_dict(
    d: Mapping[str, Any], device: torch.device | str | None = None
) -> LossScale:
    """Rebuild any loss-scale record from its ``state_dict()``, dispatching on ``d["type"]``.

    Args:
        d: the output of one of the records' ``state_dict()``.
        device: where to put the tensors (default: the CPU).

    Returns:
        A :class:`NoOpLossScale`, :class:`StaticLossScale` or :class:`DynamicLossScale`.

    Raises:
        ValueError: ``d`` is not a dict, has no known ``type``, or the class's
            ``from_state_dict`` rejects it.

    Example:
        >>> fmp.loss_scale.loss_scale_from_state_dict({"type": "NoOpLossScale"})
        NoOpLossScale()
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"loss_scale_from_state_dict needs a dict, got {type(d).__name__}")
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _CLASSES:
        raise ValueError(
            f"unknown loss-scale type {kind!r} in the state dict; accepted: "
            f"{', '.join(_CLASSES)}"
        )
    return _CLASSES[kind].from_state_dict(d, device=device)
