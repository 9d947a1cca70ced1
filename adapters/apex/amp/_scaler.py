"""One loss scaler per ``loss_id``: a holder of an fmp loss-scale record.

The scaling rule itself is the core's: :class:`fmp.DynamicLossScale` (``adjust``) for
``loss_scale="dynamic"``, :class:`fmp.StaticLossScale` for a number. This file only swaps
records, reads them back for the log and the checkpoint, and reports overflows.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

import fmp
from adapters.apex.amp._log import RateLimitedLog

__all__ = ["LossScaler", "default_floor"]

_TINY = 2.0**-126  # smallest normal float32: "no floor" (min_loss_scale=0) in Apex terms


def default_floor(min_loss_scale: float | None, max_loss_scale: float) -> float:
    """The floor of a dynamic scale: ``min_loss_scale`` or, when None, 1.0.

    Apex had no floor unless ``min_loss_scale`` was set, and scales fell toward 0.
    Here the default floor is 1.0 (or ``max_loss_scale`` if that is lower);
    ``min_loss_scale=0`` asks for no floor and gets the smallest normal float32.

    Example:
        >>> default_floor(None, 2.0**24), default_floor(0.25, 2.0**24)
        (1.0, 0.25)
    """
    if min_loss_scale is None:
        return min(1.0, float(max_loss_scale))
    if min_loss_scale == 0:
        return _TINY
    return float(min_loss_scale)


class _Pending:
    """A small device tensor being copied to the host without blocking."""

    def __init__(self, values: torch.Tensor, what: str) -> None:
        self.what = what
        self.event: Any = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values.detach().to("cpu")

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class LossScaler:
    """The loss scaler of one ``loss_id``.

    Args:
        index: the loss id (for messages).
        loss_scale: ``"dynamic"`` or a positive number.
        min_loss_scale: the floor of a dynamic scale (see :func:`default_floor`).
        max_loss_scale: the cap of a dynamic scale; it starts at
            ``min(max_loss_scale, 2**16)``.
        scale_window: clean steps before the dynamic scale doubles (Apex: 2000).
        device: where the record's tensors live (the gradients' device).
        log: the rate-limited log of the owning Amp.

    Example:
        >>> s = LossScaler(0, "dynamic", None, 2.0**24, 2000, "cpu", RateLimitedLog(0))
        >>> s.state_dict()
        {'loss_scale': 65536.0, 'unskipped': 0}
    """

    def __init__(self, index: int, loss_scale: str | float, min_loss_scale: float | None,
                 max_loss_scale: float, scale_window: int, device: torch.device | str,
                 log: RateLimitedLog) -> None:
        self.index = index
        self.dynamic = loss_scale == "dynamic"
        self.log = log
        self._pending: deque[_Pending] = deque()
        self.static_unskipped = 0
        #: the host value of a static scale (None when dynamic): no sync to read it
        self.static_value: float | None = None if self.dynamic else float(loss_scale)
        self.record: fmp.DynamicLossScale | fmp.StaticLossScale
        if self.dynamic:
            floor = default_floor(min_loss_scale, max_loss_scale)
            self.record = fmp.DynamicLossScale.create(
                initial=min(float(max_loss_scale), 2.0**16), period=scale_window, factor=2.0,
                min_scale=floor, max_scale=float(max_loss_scale), device=device)
        else:
            self.record = fmp.StaticLossScale(float(loss_scale), device=device)

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current scale, a 0-d float32 tensor on the record's device."""
        return self.record.loss_scale

    def to(self, device: torch.device) -> None:
        """Move the record to ``device`` (when the model moved after initialize)."""
        if self.record.loss_scale.device != device:
            self.record = self.record.to(device)

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a 0-d float32 tensor (computed in float32, like fmp's unscale)."""
        return torch.reciprocal(self.record.loss_scale)

    # ----------------------------------------------------------------------------------
    def update(self, found_inf: torch.Tensor, sync: bool) -> bool:
        """Move the scale after one ``scale_loss`` exit.

        Args:
            found_inf: 0-d float32, 1.0 when the new gradients overflowed.
            sync: read the verdict now (one host sync: Apex's behaviour); False keeps it
                on the device (fused optimizers skip there) and logs it later.

        Returns:
            Whether the steps are to be skipped (always False when ``sync`` is False,
            and for a static scale, which never skips).
        """
        old = self.record
        self.record = old.adjust(found_inf == 0)
        if not self.dynamic:
            self.static_unskipped += 1
        values = torch.stack([found_inf.to(old.loss_scale.device), old.loss_scale,
                              self.record.loss_scale])
        if sync:
            found, before, after = values.tolist()
            self._report(found, before, after)
            return self.dynamic and found != 0
        self._pending.append(_Pending(values, "overflow"))
        self.poll()
        return False

    def poll(self, block: bool = False) -> None:
        """Log the verdicts of earlier exits whose values reached the host."""
        while self._pending and (block or self._pending[0].ready()):
            found, before, after = self._pending.popleft().values()
            self._report(found, before, after)

    def _report(self, found: float, before: float, after: float) -> None:
        if not found:
            return
        i = self.index
        if not self.dynamic:
            self.log.warning(f"static{i}", f"Gradient overflow with static loss scale {before} "
                             f"(loss scaler {i}); the step is NOT skipped (a static scale "
                             f"never skips, as in Apex)")
            return
        if after >= before:  # an overflow that could not shrink the scale: at the floor
            self.log.warning(f"floor{i}", f"Gradient overflow although loss scaler {i} is at "
                             f"its floor min_loss_scale={self.record.min_scale}; the step is "
                             f"skipped and the scale cannot shrink further")
        self.log.info(f"overflow{i}", f"Gradient overflow. Skipping step, loss scaler {i} "
                      f"reducing loss scale to {after}")

    # ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Apex's per-scaler entry: ``{"loss_scale": float, "unskipped": int}`` (syncs)."""
        self.poll(block=True)
        if self.dynamic:
            d = self.record.state_dict()
            return {"loss_scale": d["loss_scale"], "unskipped": d["counter"]}
        return {"loss_scale": self.record.loss_scale.item(), "unskipped": self.static_unskipped}

    def load_state_dict(self, d: Any) -> None:
        """Restore from Apex's per-scaler entry (values out of bounds are clamped, logged).

        Raises:
            ValueError: the entry is not a dict with numeric ``loss_scale`` and
                ``unskipped``.
        """
        try:
            scale, unskipped = float(d["loss_scale"]), int(d["unskipped"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"loss_scaler{self.index} entry must be a dict with numeric "
                             f"'loss_scale' and 'unskipped', got {d!r}") from None
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss_scaler{self.index}: loss_scale must be a positive finite "
                             f"number, got {scale!r}")
        device = self.record.loss_scale.device
        if not self.dynamic:
            self.record = fmp.StaticLossScale(scale, device=device)
            self.static_value = float(self.record.loss_scale.item())
            self.static_unskipped = unskipped
            return
        r = self.record
        assert isinstance(r, fmp.DynamicLossScale)
        clamped = min(max(scale, r.min_scale), r.max_scale)
        counter = min(max(unskipped, 0), r.period - 1)
        if clamped != scale or counter != unskipped:
            self.log.warning(f"load{self.index}", f"loss_scaler{self.index}: loaded "
                             f"loss_scale={scale}, unskipped={unskipped} clamped to "
                             f"{clamped}, {counter} (min_loss_scale={r.min_scale}, "
                             f"max_loss_scale={r.max_scale}, window={r.period})")
        self.record = fmp.DynamicLossScale(
            clamped, counter, 0, period=r.period, factor=r.factor, min_scale=r.min_scale,
            max_scale=r.max_scale, hysteresis=r.hysteresis).to(device)
