"""The record of a fixed loss scale."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from fmp._records import register, with_leaves
from fmp.loss_scale._scaling import scale_tree
from fmp.loss_scale._unscale import Unscaling
from fmp.loss_scale._validate import (
    check_state_dict,
    is_concrete,
    number,
    positive_f32,
    scalar_tensor,
)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(Unscaling):
    """A fixed loss scale: ``StaticLossScale(loss_scale, device=None)``.

    The constructor validates the scale (see ``__post_init__``); the arithmetic never does.

    Attributes:
        loss_scale: the scale, a 0-d float32 tensor (the record's only leaf).

    Example:
        >>> ls = fmp.StaticLossScale(128.0)
        >>> ls.scale(torch.tensor(2.0))
        tensor(256.)
        >>> ls.unscale({"w": torch.tensor([256.0])})
        {'w': tensor([2.])}
    """

    loss_scale: torch.Tensor
    device: dataclasses.InitVar[torch.device | str | None] = None

    def __post_init__(self, device: torch.device | str | None) -> None:
        """Validate and convert the scale (``StaticLossScale(loss_scale, device=None)``).

        Args:
            loss_scale: a positive finite Python number or a one-element tensor; it is
                stored as a 0-d float32 tensor. A tensor's value is checked only when it
                is a plain CPU tensor (reading a device tensor would synchronise).
            device: where to put the scale; ``None`` keeps a tensor's device, and puts a
                number on the CPU.

        Raises:
            ValueError: the scale is not a number or a one-element real tensor, or it is
                <= 0, non-finite, or out of float32 range.

        Example:
            >>> fmp.StaticLossScale(2**10).loss_scale
            tensor(1024.)
        """
        loss_scale: Any = self.loss_scale
        if isinstance(loss_scale, torch.Tensor):
            t = scalar_tensor(loss_scale, torch.float32, "loss_scale", device)
            if is_concrete(t):
                v = t.item()
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(
                        f"loss_scale must be a finite float32 > 0, got {loss_scale!r}"
                    )
        else:
            positive_f32(loss_scale, "loss_scale")
            t = torch.tensor(float(loss_scale), dtype=torch.float32, device=device)
        object.__setattr__(self, "loss_scale", t)

    def _scale_or_none(self) -> torch.Tensor:
        return self.loss_scale

    def scale(self, tree: T) -> T:
        """Multiply every floating-point tensor leaf of ``tree`` by the scale.

        A float32 leaf stays float32 and a float64 leaf float64. A narrower leaf
        (bfloat16, float16) is multiplied in float32 and **comes back float32**: a scaled
        loss would often overflow float16 (2 * 65536 is already inf), and the gradient of
        the float32 result flows back to the narrow leaf in its own dtype. Other leaves
        pass through; the input is not modified.

        Args:
            tree: any pytree, usually the loss (a 0-d tensor).

        Returns:
            A new tree of the same structure.

        Example:
            >>> fmp.StaticLossScale(4.0).scale(torch.tensor(1.5, dtype=torch.bfloat16))
            tensor(6.)
        """
        return scale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: torch.Tensor) -> StaticLossScale:
        """Return ``self``: a static scale never changes.

        Args:
            grads_finite: ignored.

        Returns:
            ``self``.

        Example:
            >>> ls = fmp.StaticLossScale(8.0)
            >>> ls.adjust(torch.tensor(False)) is ls
            True
        """
        return self

    def to(self, device: torch.device | str) -> StaticLossScale:
        """The record with its scale on ``device``.

        Args:
            device: the target device.

        Returns:
            A new record (``self`` if the scale is already there).

        Example:
            >>> fmp.StaticLossScale(8.0).to("cpu").loss_scale.device
            device(type='cpu')
        """
        t = self.loss_scale.to(device)
        return self if t is self.loss_scale else with_leaves(self, [t])

    def state_dict(self) -> dict[str, Any]:
        """The record as a plain dict of Python numbers, for checkpoints.

        The scale is stored as the Python float equal to the float32 value (exact), so
        :meth:`from_state_dict` restores it bit for bit. Reading it synchronises the host
        when the scale lives on a device.

        Returns:
            ``{"type": "StaticLossScale", "loss_scale": float}``.

        Example:
            >>> fmp.StaticLossScale(128.0).state_dict()
            {'type': 'StaticLossScale', 'loss_scale': 128.0}
        """
        return {"type": "StaticLossScale", "loss_scale": self.loss_scale.item()}

    @classmethod
    def from_state_dict(
        cls, d: Mapping[str, Any], device: torch.device | str | None = None
    ) -> StaticLossScale:
        """Rebuild the record from :meth:`state_dict`'s output.

        Args:
            d: a dict with exactly the keys ``type`` (``"StaticLossScale"``) and
                ``loss_scale`` (a number or a one-element tensor).
            device: where to put the scale (default: the CPU).

        Returns:
            A new :class:`StaticLossScale`.

        Raises:
            ValueError: missing or unknown keys (named in the message), another type, or
                an invalid scale.

        Example:
            >>> fmp.StaticLossScale.from_state_dict(
            ...     {"type": "StaticLossScale", "loss_scale": 128.0}).loss_scale
            tensor(128.)
        """
        check_state_dict(d, cls.__name__, ("type", "loss_scale"))
        return cls(number(d["loss_scale"], "loss_scale"), device=device)


StaticLossScale.__module__ = "fmp.loss_scale"  # its public home: pickles and safe globals name it
register(StaticLossScale)
