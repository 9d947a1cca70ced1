"""The record of a dynamic loss scale: grows while grads stay finite, shrinks on overflow."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from fmp._records import field_table, register, static, unchecked, with_leaves
from fmp.loss_scale._scaling import scale_tree
from fmp.loss_scale._unscale import Unscaling
from fmp.loss_scale._validate import (
    as_finite_flag,
    check_hyper_parameters,
    check_in_bounds,
    check_state_dict,
    int_in,
    is_concrete,
    number,
    positive_f32,
    scalar_tensor,
)

T = TypeVar("T")


def _wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype the growth/back-off product is computed in before rounding to float32.

    torch's ``_amp_update_scale_`` multiplies the float32 scale by a double factor and
    rounds the double product to float32; computing in float64 reproduces that exactly.
    MPS has no float64, so there the product is computed in float32.
    """
    return torch.float32 if device.type == "mps" else torch.float64


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(Unscaling):
    """A loss scale that grows while gradients stay finite and shrinks on overflow.

    Build it with :meth:`create`. ``adjust(grads_finite)`` returns the next record:

    - finite step: ``counter + 1``; when it reaches ``period`` the scale becomes
      ``min(scale * factor, max_scale)`` (never inf) and ``counter`` 0. ``overflows``
      resets to 0.
    - non-finite step: ``counter`` 0 and ``overflows + 1``; when it reaches
      ``hysteresis`` the scale becomes ``max(scale / factor, min_scale)`` and
      ``overflows`` 0. With ``hysteresis=1`` (the default) every overflow shrinks the
      scale; with ``hysteresis=N`` only the N-th overflow in a row does (DeepSpeed-style
      delayed shift; any finite step in between starts the count again).

    With ``hysteresis=1`` the trajectory equals ``torch.amp.GradScaler``'s
    (``growth_factor=factor``, ``backoff_factor=1/factor``, ``growth_interval=period``)
    bit for bit, as long as the bounds are not reached: the products are computed like
    torch's kernel (float32 scale times the double factor, rounded once to float32).
    The bounds apply as their nearest float32 values.

    Attributes:
        loss_scale: the scale, a 0-d float32 tensor (leaf).
        counter: finite steps since the scale last changed, a 0-d int32 tensor (leaf).
        overflows: consecutive overflows not yet acted on, a 0-d int32 tensor (leaf;
            always 0 when ``hysteresis=1``).
        period: finite steps between two growths (int, metadata).
        factor: the growth factor; the back-off multiplies by ``1/factor`` (float,
            metadata).
        min_scale: the floor (float, metadata).
        max_scale: the cap (float, metadata).
        hysteresis: overflows in a row needed to shrink the scale (int, metadata).

    Example:
        >>> ls = fmp.DynamicLossScale.create(initial=8.0, period=2)
        >>> ls = ls.adjust(torch.tensor(True)).adjust(torch.tensor(True))
        >>> ls.loss_scale, ls.counter
        (tensor(16.), tensor(0, dtype=torch.int32))
        >>> ls.adjust(torch.tensor(False)).loss_scale
        tensor(8.)
    """

    loss_scale: torch.Tensor
    counter: torch.Tensor = 0  # type: ignore[assignment]  # an int is converted
    overflows: torch.Tensor = 0  # type: ignore[assignment]
    period: int = static(2000)
    factor: float = static(2.0)
    min_scale: float = static(1.0)
    max_scale: float = static(2.0**24)
    hysteresis: int = static(1)

    def __post_init__(self) -> None:
        """Create the record from its fields (prefer :meth:`create`).

        The counters go on the scale's device. Tensor values are checked only when they
        are plain CPU tensors (reading a device tensor would synchronise).

        Args:
            loss_scale: the current scale, a number or a one-element tensor, in
                ``[min_scale, max_scale]``.
            counter: finite steps since the last change, in ``[0, period)``.
            overflows: consecutive overflows not yet acted on, in ``[0, hysteresis)``.
            period: see the class docstring; an int >= 1.
            factor: a finite number > 1.
            min_scale: a positive finite number <= ``max_scale``.
            max_scale: a positive finite number within float32 range.
            hysteresis: an int >= 1.

        Raises:
            ValueError: any value out of its range; the message names it.

        Example:
            >>> fmp.DynamicLossScale(1024.0, period=10).period
            10
        """
        loss_scale, counter, overflows = self.loss_scale, self.counter, self.overflows
        period, factor, min_scale, max_scale, hysteresis = check_hyper_parameters(
            self.period, self.factor, self.min_scale, self.max_scale, self.hysteresis
        )
        if isinstance(loss_scale, torch.Tensor):
            scale_t = scalar_tensor(loss_scale, torch.float32, "loss_scale")
        else:
            positive_f32(loss_scale, "loss_scale")
            scale_t = torch.tensor(float(loss_scale), dtype=torch.float32)
        device = scale_t.device
        counter_t = scalar_tensor(counter, torch.int32, "counter", device)
        overflows_t = scalar_tensor(overflows, torch.int32, "overflows", device)
        if not isinstance(counter, torch.Tensor):
            int_in(counter, "counter", 0, period - 1)
        if not isinstance(overflows, torch.Tensor):
            int_in(overflows, "overflows", 0, hysteresis - 1)
        if is_concrete(scale_t):
            v = scale_t.item()
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"loss_scale must be a finite float32 > 0, got {loss_scale!r}")
            check_in_bounds(v, min_scale, max_scale, "loss_scale")
        if is_concrete(counter_t):
            int_in(counter_t.item(), "counter", 0, period - 1)
        if is_concrete(overflows_t):
            int_in(overflows_t.item(), "overflows", 0, hysteresis - 1)
        leaves, meta = field_table(DynamicLossScale)
        for name, value in zip(
            (*leaves, *meta),
            (scale_t, counter_t, overflows_t, period, factor, min_scale, max_scale,
             hysteresis),
            strict=True,
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def create(
        cls,
        initial: float = 2.0**16,
        period: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        device: torch.device | str | None = None,
    ) -> DynamicLossScale:
        """A fresh dynamic loss scale (counters at 0).

        Args:
            initial: the starting scale, in ``[min_scale, max_scale]`` (it is not
                clamped: an out-of-range value is rejected).
            period: finite steps between two growths, an int >= 1 (GradScaler's
                ``growth_interval``).
            factor: growth factor, a finite number > 1; the back-off multiplies by
                ``1/factor`` (GradScaler's ``backoff_factor``).
            min_scale: the floor, a positive finite number.
            max_scale: the cap, a finite number >= ``min_scale`` within float32 range.
            hysteresis: overflows in a row needed to shrink the scale, an int >= 1.
            device: where the three tensors live (default: the CPU). Keep it on the
                device of the gradients so that no step copies it.

        Returns:
            A new :class:`DynamicLossScale`.

        Raises:
            ValueError: any value out of its range; the message names the value and what
                is accepted.

        Example:
            >>> ls = fmp.DynamicLossScale.create(min_scale=0.25)
            >>> ls.loss_scale, ls.min_scale
            (tensor(65536.), 0.25)
        """
        period, factor, min_scale, max_scale, hysteresis = check_hyper_parameters(
            period, factor, min_scale, max_scale, hysteresis
        )
        initial_f = positive_f32(initial, "initial")
        check_in_bounds(initial_f, min_scale, max_scale, "initial")
        return unchecked(cls, (
            torch.tensor(initial_f, dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
        ), (period, factor, min_scale, max_scale, hysteresis))

    def _scale_or_none(self) -> torch.Tensor:
        return self.loss_scale

    def scale(self, tree: T) -> T:
        """Multiply every floating-point tensor leaf of ``tree`` by the current scale.

        Same rules as :meth:`StaticLossScale.scale`: float32 stays float32, float64
        stays float64, bfloat16/float16 leaves are multiplied in float32 and come back
        float32; other leaves pass through; the input is not modified.

        Args:
            tree: any pytree, usually the loss.

        Returns:
            A new tree of the same structure.

        Example:
            >>> fmp.DynamicLossScale.create(initial=8.0).scale(torch.tensor(0.5))
            tensor(4.)
        """
        return scale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: torch.Tensor | bool) -> DynamicLossScale:
        """The next record after a step whose gradients were (not) finite.

        Branch-free (``torch.where``): no host synchronisation, traceable by
        ``torch.compile(fullgraph=True)``, capturable in a CUDA graph, batched under
        ``torch.func.vmap``. See the class docstring for the rule.

        Args:
            grads_finite: a 0-d bool tensor, e.g. ``fmp.all_finite(grads)`` (a Python
                bool is accepted too).

        Returns:
            A new :class:`DynamicLossScale` with the same hyper-parameters.

        Raises:
            ValueError: ``grads_finite`` is not a 0-d bool tensor or a bool.

        Example:
            >>> ls = fmp.DynamicLossScale.create(initial=4.0, min_scale=0.25)
            >>> for _ in range(5):
            ...     ls = ls.adjust(torch.tensor(False))
            >>> ls.loss_scale
            tensor(0.2500)
        """
        scale = self.loss_scale
        finite = as_finite_flag(grads_finite, scale.device)
        wide = scale.to(_wide_dtype(scale.device))
        grown = torch.clamp(wide * self.factor, max=self.max_scale).to(torch.float32)
        shrunk = torch.clamp(wide * (1.0 / self.factor), min=self.min_scale).to(torch.float32)
        counter = self.counter + 1
        grow = counter >= self.period
        overflows = self.overflows + 1
        shrink = overflows >= self.hysteresis
        zero = torch.zeros_like(self.counter)
        new_scale = torch.where(
            finite, torch.where(grow, grown, scale), torch.where(shrink, shrunk, scale)
        )
        new_counter = torch.where(finite & ~grow, counter, zero)
        new_overflows = torch.where(finite | shrink, zero, overflows)
        return with_leaves(self, (new_scale, new_counter, new_overflows))

    def to(self, device: torch.device | str) -> DynamicLossScale:
        """The record with its tensors on ``device`` (hyper-parameters unchanged).

        Args:
            device: the target device.

        Returns:
            A new record.

        Example:
            >>> fmp.DynamicLossScale.create().to("cpu").counter.device
            device(type='cpu')
        """
        return with_leaves(self, (self.loss_scale.to(device), self.counter.to(device),
                                  self.overflows.to(device)))

    def state_dict(self) -> dict[str, Any]:
        """The record as a plain dict of Python numbers, for checkpoints.

        The scale is stored as the Python float equal to its float32 value (exact) and
        the counters as ints, so :meth:`from_state_dict` restores the record bit for bit.
        Reading the tensors synchronises the host when they live on a device.

        Returns:
            A dict with the keys ``type`` (``"DynamicLossScale"``), ``loss_scale``,
            ``counter``, ``overflows``, ``period``, ``factor``, ``min_scale``,
            ``max_scale`` and ``hysteresis``.

        Example:
            >>> fmp.DynamicLossScale.create().state_dict()["loss_scale"]
            65536.0
        """
        return {
            "type": "DynamicLossScale",
            "loss_scale": self.loss_scale.item(),
            "counter": int(self.counter.item()),
            "overflows": int(self.overflows.item()),
            "period": self.period,
            "factor": self.factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
        }

    @classmethod
    def from_state_dict(
        cls, d: Mapping[str, Any], device: torch.device | str | None = None
    ) -> DynamicLossScale:
        """Rebuild the record from :meth:`state_dict`'s output.

        Args:
            d: a dict with exactly the keys of :meth:`state_dict`; the scale and the
                counters may be numbers or one-element tensors.
            device: where to put the tensors (default: the CPU).

        Returns:
            A new :class:`DynamicLossScale`, equal field for field to the saved one.

        Raises:
            ValueError: missing or unknown keys (named in the message), another type, or
                any value out of its range (as for :meth:`create`; the counters must lie
                in ``[0, period)`` and ``[0, hysteresis)``).

        Example:
            >>> ls = fmp.DynamicLossScale.create(period=3, min_scale=0.25)
            >>> fmp.DynamicLossScale.from_state_dict(ls.state_dict()).min_scale
            0.25
        """
        leaves, meta = field_table(cls)
        check_state_dict(d, cls.__name__, ("type", *leaves, *meta))
        scale = number(d["loss_scale"], "loss_scale")
        out = cls(
            scale,
            number(d["counter"], "counter"),
            number(d["overflows"], "overflows"),
            period=d["period"],
            factor=d["factor"],
            min_scale=d["min_scale"],
            max_scale=d["max_scale"],
            hysteresis=d["hysteresis"],
        )
        return out if device is None else out.to(device)


DynamicLossScale.__module__ = "fmp.loss_scale"  # its public home: pickles and safe globals name it
register(DynamicLossScale)
