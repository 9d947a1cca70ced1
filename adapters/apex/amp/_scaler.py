"""One loss scaler per ``loss_id``: a holder of an fmp loss-scale record.

The scaling rule itself is the core's: :class:`fmp.DynamicLossScale` (``adjust``) for
``loss_scale="dynamic"``, :class:`fmp.StaticLossScale` for a number. This file only swaps
records, reads them back for the log and the checkpoint, and reports overflows.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

import fmp
from adapters.apex.amp._log import RateLimitedLog

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
            self.host = torch.empty(values.shape, dtype=values.dtype, device="cpu",
                                    pin_memory=True)
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

    def check_state(self, d: Any) -> tuple[float, int]:
        """Validate Apex's per-scaler entry for this scaler; change nothing.

        Returns:
            ``(loss_scale, unskipped)``.

        Raises:
            ValueError: the entry is not a dict with a real ``loss_scale`` and an integer
                ``unskipped``, the scale is not positive and finite, or this scaler has a
                fixed scale and the entry holds another one (a checkpoint of a dynamic
                scale, or of another fixed scale: loading it would change the scale).
        """
        what = f"loss_scaler{self.index}"
        if not isinstance(d, Mapping) or "loss_scale" not in d or "unskipped" not in d:
            raise ValueError(f"{what} entry must be a dict with numeric 'loss_scale' and "
                             f"integer 'unskipped', got {d!r}")
        scale, unskipped = _number(d["loss_scale"], False), _number(d["unskipped"], True)
        if scale is None:
            raise ValueError(f"{what}: 'loss_scale' must be a real number, got "
                             f"{d['loss_scale']!r}")
        if unskipped is None:
            raise ValueError(f"{what}: 'unskipped' must be an int, got {d['unskipped']!r}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{what}: loss_scale must be a positive finite number, "
                             f"got {scale!r}")
        if not self.dynamic and _f32(scale) != _f32(self.static_value):
            raise ValueError(
                f"{what}: the checkpoint holds loss_scale={scale!r}, but this scaler has the "
                f"fixed loss_scale={self.static_value!r} of its opt level; loading it would "
                f"silently change the scale (a checkpoint of a dynamic scale?). Initialize "
                f"with the loss_scale the checkpoint was saved with (loss_scale='dynamic' or "
                f"loss_scale={scale!r}), or do not load amp's state")
        return float(scale), int(unskipped)

    def load_state_dict(self, d: Any) -> None:
        """Restore from Apex's per-scaler entry (values out of bounds are clamped, logged).

        Raises:
            ValueError: see :meth:`check_state` (nothing is changed then).
        """
        self.apply_state(*self.check_state(d))

    def set_scale(self, scale: Any = None, unskipped: Any = None) -> None:
        """Set the scale and/or the unskipped counter as given (Apex's ``_loss_scale = x``).

        Unlike :meth:`load_state_dict`, a fixed scale takes the new value too, and a dynamic
        scale is not clamped to its bounds (Apex assigned the attribute as it was).

        Raises:
            ValueError: ``scale`` is not a positive finite number, or ``unskipped`` is not a
                non-negative int (nothing is changed then).
        """
        if scale is not None:
            value = _number(scale, False)
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(f"loss_scaler{self.index}: _loss_scale must be a positive "
                                 f"finite number, got {scale!r}")
            scale = float(value)
        if unskipped is not None:
            count = _number(unskipped, True)
            if count is None or count < 0:
                raise ValueError(f"loss_scaler{self.index}: _unskipped must be a "
                                 f"non-negative int, got {unskipped!r}")
            unskipped = int(count)
        self.poll(block=True)
        device = self.record.loss_scale.device
        if not self.dynamic:
            if scale is not None:
                self.record = fmp.StaticLossScale(scale, device=device)
                self.static_value = scale
            if unskipped is not None:
                self.static_unskipped = unskipped
            return
        r = self.record
        assert isinstance(r, fmp.DynamicLossScale)
        d = r.state_dict()
        self.record = fmp.DynamicLossScale(
            d["loss_scale"] if scale is None else scale,
            d["counter"] if unskipped is None else min(unskipped, r.period - 1), 0,
            period=r.period, factor=r.factor, min_scale=r.min_scale, max_scale=r.max_scale,
            hysteresis=r.hysteresis).to(device)

    def apply_state(self, scale: float, unskipped: int) -> None:
        """Set the values :meth:`check_state` returned."""
        device = self.record.loss_scale.device
        if not self.dynamic:
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


def _f32(v: Any) -> float:
    """``v`` rounded to float32 (the dtype of the scale records), on the host."""
    return float(torch.tensor(float(v), dtype=torch.float32))


def _number(v: Any, integral: bool) -> float | int | None:
    """``v`` as a Python number (a one-element tensor too); None when it is not one.

    Booleans are refused; ``integral`` also refuses non-integral values (2.5 unskipped).
    """
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype == torch.bool or v.is_complex():
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    if integral:
        if isinstance(v, numbers.Integral):
            return int(v)
        return int(v) if float(v).is_integer() else None
    return float(v)
