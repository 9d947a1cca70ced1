"""Loss scalers of ``apex.fp16_utils``.

:class:`LossScaler` and :class:`DynamicLossScaler` are the standalone classes Apex exported
from ``apex.fp16_utils`` (scale, check, update by hand). :class:`AmpLossScaler` is the rule
``FP16_Optimizer`` used (Apex's ``amp.scaler.LossScaler``): a dynamic scale starts at
``2**16``, halves on an overflow (the step is skipped) and doubles after ``scale_window``
clean steps, capped at ``max_loss_scale``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from adapters.apex.amp._scaler import default_floor


def _has_inf_or_nan(x: torch.Tensor) -> bool:
    return not bool(torch.isfinite(x).all())


class LossScaler:
    """A static loss scale (Apex's ``fp16_utils.LossScaler``); never reports an overflow.

    Example:
        >>> s = LossScaler(128.0); s.loss_scale, s.has_overflow([])
        (128.0, False)
    """

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: Any) -> tuple:
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """Apex's ``fp16_utils.DynamicLossScaler``: divide by ``scale_factor`` on an overflow
    (not below 1), multiply after ``scale_window`` iterations without one.

    Example:
        >>> s = DynamicLossScaler(init_scale=8.0, scale_window=2)
        >>> s.update_scale(True); s.update_scale(False); s.update_scale(False); s.loss_scale
        8.0
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0,
                 scale_window: int = 1000) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and _has_inf_or_nan(p.grad) for p in params)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class AmpLossScaler:
    """The scale of an :class:`FP16_Optimizer`: static (a number) or ``"dynamic"``.

    Args:
        loss_scale: a number, or ``"dynamic"``.
        init_scale: the first dynamic scale (2**16).
        scale_factor: the factor of each change (2).
        scale_window: clean steps before growing (2000).
        min_loss_scale: the floor (None: 1.0, as the amp adapter; Apex had none).
        max_loss_scale: the cap (2**24).

    Raises:
        ValueError: a non-positive or non-finite scale, or a bad window or factor.

    Example:
        >>> s = AmpLossScaler("dynamic", scale_window=2)
        >>> s.update_scale(True), s.loss_scale()
        (True, 32768.0)
    """

    def __init__(self, loss_scale: float | str, init_scale: float = 2.0**16,
                 scale_factor: float = 2.0, scale_window: int = 2000,
                 min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24) -> None:
        self.dynamic = loss_scale == "dynamic"
        scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"FP16_Optimizer: the loss scale must be a positive finite number "
                             f"or 'dynamic', got {loss_scale if not self.dynamic else scale!r}")
        if not (isinstance(scale_window, int) and scale_window >= 1):
            raise ValueError(f"FP16_Optimizer: scale_window must be an int >= 1, "
                             f"got {scale_window!r}")
        if not scale_factor > 1:
            raise ValueError(f"FP16_Optimizer: scale_factor must be > 1, got {scale_factor!r}")
        self._loss_scale = float(scale)
        self._scale_factor = float(scale_factor)
        self._scale_seq_len = scale_window
        self._min_loss_scale = default_floor(min_loss_scale, max_loss_scale)
        self._max_loss_scale = float(max_loss_scale)
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> float:
        """The current scale."""
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        self._has_overflow = False

    def unscale(self, model_grads: list[torch.Tensor], master_grads: list[torch.Tensor],
                scale: float) -> None:
        """``master = model / scale``; a dynamic scaler records an inf/NaN in the model's."""
        if not model_grads:
            return
        if self.dynamic and not self._has_overflow:
            self._has_overflow = any(_has_inf_or_nan(g) for g in model_grads)
        with torch.no_grad():
            for model, master in zip(model_grads, master_grads, strict=True):
                if master is model:
                    master.mul_(1.0 / scale)
                else:
                    master.copy_(model.float() * (1.0 / scale))

    def update_scale(self, overflow: bool | None = None) -> bool:
        """Apply the rule after an iteration; returns True when the step must be skipped."""
        if overflow is not None:
            self._has_overflow = bool(overflow)
        skip = self._has_overflow and self.dynamic
        if skip:
            self._loss_scale = max(self._min_loss_scale, self._loss_scale / self._scale_factor)
            self._unskipped = 0
        else:
            self._unskipped += 1
        if self.dynamic and self._unskipped == self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return skip

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers, loadable with ``torch.load(weights_only=True)``."""
        return {"loss_scale": self._loss_scale, "dynamic": self.dynamic,
                "unskipped": self._unskipped, "scale_factor": self._scale_factor,
                "scale_window": self._scale_seq_len, "min_loss_scale": self._min_loss_scale,
                "max_loss_scale": self._max_loss_scale}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s numbers.

        Raises:
            ValueError: ``d`` lacks a key or is not a dict.
        """
        keys = ("loss_scale", "dynamic", "unskipped")
        if not isinstance(d, dict) or any(k not in d for k in keys):
            raise ValueError(f"FP16_Optimizer.load_state_dict: 'loss_scaler' must be a dict "
                             f"with keys {keys}, got {d!r}")
        self._loss_scale = float(d["loss_scale"])
        self.dynamic = bool(d["dynamic"])
        self._unskipped = int(d["unskipped"])
        self._scale_factor = float(d.get("scale_factor", self._scale_factor))
        self._scale_seq_len = int(d.get("scale_window", self._scale_seq_len))
        self._min_loss_scale = float(d.get("min_loss_scale", self._min_loss_scale))
        self._max_loss_scale = float(d.get("max_loss_scale", self._max_loss_scale))
