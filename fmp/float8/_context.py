"""The float8 records a running train step publishes to the layers its ``loss_fn`` calls.

A layer inside ``loss_fn`` sees only its params (through ``torch.func.functional_call``),
not the :class:`fmp.TrainState`. While the step calls ``loss_fn`` (one micro-batch) it
publishes ``state.float8`` here, with the probe tensor it differentiates for each
layer (the probe's gradient is the layer's amaxes: see
``fmp/float8/_linear.py``). Outside a step nothing is published and the layers scale
dynamically. A single slot, as :data:`fmp._model.ACTIVE`: steps do not nest their loss calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class Published:
    """What the running step published (all None outside a step).

    Attributes:
        records: ``{qualified name: Float8LinearScales}`` or None.
        probes: ``{qualified name: float32 [3] probe}``, one per record, or None.
        used: the delayed layers called so far in this loss call.
    """

    def __init__(self) -> None:
        self.records: Mapping[str, Any] | None = None
        self.probes: Mapping[str, torch.Tensor] | None = None
        self.used: list[str] = []


#: the running loss call's float8 records (a single slot)
CURRENT = Published()


def publish(records: Mapping[str, Any] | None, probes: Mapping[str, torch.Tensor] | None
            ) -> tuple[Any, Any, Any]:
    """Publish ``records`` and ``probes``; returns what to give :func:`restore` after."""
    prev = (CURRENT.records, CURRENT.probes, CURRENT.used)
    CURRENT.records, CURRENT.probes, CURRENT.used = records, probes, []
    return prev


def restore(prev: tuple[Any, Any, Any]) -> None:
    """Put back what :func:`publish` replaced."""
    CURRENT.records, CURRENT.probes, CURRENT.used = prev


def lookup(name: str | None) -> tuple[Any, torch.Tensor | None]:
    """``(record, probe)`` for the layer ``name``: ``(None, None)`` outside a step, else its
    record and the probe the step differentiates for it (None where it made none).

    Raises:
        ValueError: a step with float8 records runs a layer that has none (the message names
            it), or calls a delayed-scaling layer a second time in one loss call.
    """
    records = CURRENT.records
    if records is None:
        return None, None
    if name is None or name not in records:
        known = ", ".join(sorted(records)[:4]) + (" ..." if len(records) > 4 else "")
        raise ValueError(
            f"fmp.float8: the Float8Linear {name!r} has no record in state.float8 (it holds "
            f"{known or 'none'}); build the records from the model that runs, "
            "state = TrainState.create(..., float8=fmp.float8.init(model))")
    record = records[name]
    probe = None if CURRENT.probes is None else CURRENT.probes.get(name)
    if not record.delayed:
        return record, probe
    if name in CURRENT.used:
        raise ValueError(
            f"fmp.float8: the delayed-scaling Float8Linear {name!r} ran twice in one loss "
            "call; its record holds one amax per step (as in Transformer Engine). Use "
            "Recipe('dynamic') for layers called more than once (shared weights, "
            "activation checkpointing)")
    CURRENT.used.append(name)
    return record, probe
