"""The float8 part of a train step: probes to differentiate, amaxes to combine, records to
update (``fmp/step.py`` calls these; a step without float8 records calls none of them).

Per loss call (micro-batch) the step makes one zero float32 ``[3]`` probe per
delayed-scaling record and differentiates it with the params; the probes' grads are the
layers' amaxes (``fmp/float8/_linear.py``). They never reach the optimizer or the finite
check: a non-finite amax cannot change a scale (``Float8LinearScales.update`` keeps it),
and the records are kept only where the step is (``select_tree`` on ``finite``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fmp.float8._scales import Float8LinearScales
from fmp.tree import select_tree


def probes(records: Mapping[str, Float8LinearScales] | None) -> dict[str, torch.Tensor] | None:
    """One zero float32 ``[3]`` probe per delayed record (None: there are none)."""
    if not records:
        return None
    out = {n: torch.zeros(3, dtype=torch.float32, device=r.scale.device)
           for n, r in records.items() if r.delayed}
    return out or None


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
        out[n] = select_tree(finite, records[n].update(a), records[n])
    return out
