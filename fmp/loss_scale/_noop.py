"""The record of no loss scaling (scale 1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from fmp._records import register
from fmp.loss_scale._unscale import Unscaling
from fmp.loss_scale._validate import check_state_dict

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(Unscaling):
    """No loss scaling: the scale is 1; ``scale``, ``adjust`` and ``to`` return their input,
    and ``unscale`` returns the grads as they are (over one micro-batch).

    The record has no fields, hence no leaves. ``==`` is identity (records are compared
    by their fields with :meth:`state_dict`).

    Example:
        >>> ls = fmp.NoOpLossScale()
        >>> g = {"w": torch.ones(2)}
        >>> ls.unscale(g) is g
        True
    """

    @property
    def loss_scale(self) -> torch.Tensor:
        """The scale as a 0-d float32 tensor (always 1.0, on the CPU)."""
        return torch.ones((), dtype=torch.float32)

    def scale(self, tree: T) -> T:
        """Return ``tree`` itself, unchanged.

        Args:
            tree: any pytree (usually the loss).

        Returns:
            The same object.

        Example:
            >>> loss = torch.tensor(2.0)
            >>> fmp.NoOpLossScale().scale(loss) is loss
            True
        """
        return tree

    def _scale_or_none(self) -> None:
        return None

    def adjust(self, grads_finite: torch.Tensor) -> NoOpLossScale:
        """Return ``self``: there is nothing to adjust.

        Args:
            grads_finite: ignored.

        Returns:
            ``self``.

        Example:
            >>> ls = fmp.NoOpLossScale()
            >>> ls.adjust(torch.tensor(False)) is ls
            True
        """
        return self

    def to(self, device: torch.device | str) -> NoOpLossScale:
        """Return ``self`` (the record holds no tensors).

        Args:
            device: ignored.

        Returns:
            ``self``.

        Example:
            >>> ls = fmp.NoOpLossScale()
            >>> ls.to("cpu") is ls
            True
        """
        return self

    def state_dict(self) -> dict[str, Any]:
        """The record as a plain dict, for checkpoints.

        Returns:
            ``{"type": "NoOpLossScale"}``.

        Example:
            >>> fmp.NoOpLossScale().state_dict()
            {'type': 'NoOpLossScale'}
        """
        return {"type": "NoOpLossScale"}

    @classmethod
    def from_state_dict(
        cls, d: Mapping[str, Any], device: torch.device | str | None = None
    ) -> NoOpLossScale:
        """Rebuild the record from :meth:`state_dict`'s output.

        Args:
            d: the dict; it must hold exactly the key ``type``, equal to ``"NoOpLossScale"``.
            device: ignored (there are no tensors).

        Returns:
            A new :class:`NoOpLossScale`.

        Raises:
            ValueError: ``d`` is not a dict, has missing or unknown keys (named in the
                message), or is of another type.

        Example:
            >>> fmp.NoOpLossScale.from_state_dict({"type": "NoOpLossScale"})
            NoOpLossScale()
        """
        check_state_dict(d, cls.__name__, ("type",))
        return cls()


NoOpLossScale.__module__ = "fmp.loss_scale"  # its public home: pickles and safe globals name it
register(NoOpLossScale)
