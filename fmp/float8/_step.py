"""The float8 part of a train step: probes to differentiate, amaxes to combine, records to
update (``fmp/step.py`` calls these; a step without float8 records calls none of them).

Per loss call (micro-batch) the step makes one zero float32 ``[3]`` probe per record and
differentiates it with the params; the probes' grads are the layers' amaxes
(``fmp/float8/_linear.py``). They never reach the optimizer. They do join the finite
check (:func:`amaxes_finite`): a saturating float8 cast turns an inf in an input, weight
or scaled grad output into the format's max, so the grads could stay finite where the
same step without float8 would overflow; an inf or NaN amax makes the step skip and the
loss scale back off, as that overflow would. The records are kept only where the step
applies its update (``select_tree`` on ``finite``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fmp.float8._scales import Float8LinearScales
from fmp.tree import all_finite, select_tree


def probes(records: Mapping[str, Float8LinearScales] | None) -> dict[str, torch.Tensor] | None:
    """One zero float32 ``[3]`` probe per record (None: there are none)."""
    if not records:
        return None
    return {n: torch.zeros(3, dtype=torch.float32, device=r.scale.device)
            for n, r in records.items()}


def amaxes_finite(amaxes: Mapping[str, torch.Tensor] | None) -> torch.Tensor | None:
    """A 0-d bool tensor: every amax the float8 layers saw is finite (None: no amaxes)."""
    if not amaxes:
        return None
    return all_finite(amaxes)


def combine(total: dict[str, torch.Tensor] | None, amaxes: dict[str, torch.Tensor] | None
            ) -> dict[str, torch.Tensor] | None:
    """Two micro-batches' amaxes as one: the elementwise max (an amax of the whole batch)."""
    if total is None:
        return amaxes
    return {n: torch.maximum(total[n], a) for n, a in amaxes.items()} if amaxes else total


def updated(records: Mapping[str, Float8LinearScales] | None,
            amaxes: Mapping[str, torch.Tensor] | None, finite: torch.Tensor) -> Any:
    """The records after the step: delayed ones updated with their amaxes, kept only where
    ``finite`` (a skipped step returns them bit-identical); dynamic ones as they were."""
    if records is None or not amaxes:
        return records
    out = dict(records)
    for n, a in amaxes.items():
        if records[n].delayed:
            out[n] = select_tree(finite, records[n].update(a), records[n])
    return out


def check_no_delayed(records: Mapping[str, Float8LinearScales] | None) -> None:
    """Raise where a data-parallel step meets delayed-scaling records.

    Each replica sees its own amaxes; Transformer Engine all-reduces them (max) so that the
    replicas keep one history. A :class:`fmp.GradReducer` offers a mean, not a max, so the
    records would drift apart: refused rather than wrong.

    Raises:
        ValueError: a delayed record (the message names it).
    """
    for n, r in (records or {}).items():
        if r.delayed:
            raise ValueError(
                f"fmp.float8: the record {n!r} uses delayed scaling, which a data-parallel "
                "step does not support yet (the replicas' amaxes would need an all-reduce "
                "max); use fmp.float8.Recipe('dynamic') with process_group/reducer")
