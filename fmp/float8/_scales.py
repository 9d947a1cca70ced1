"""``Float8LinearScales``: the delayed-scaling record of one float8 linear layer.

One record per :class:`fmp.float8.Float8Linear`, carried in ``TrainState.float8`` under the
layer's qualified name. Its rows are the layer's three casts, in this order: the input
(e4m3), the weight (e4m3) and the grad output (e5m2). :meth:`Float8LinearScales.update`
is Transformer Engine's delayed-scaling recipe as a pure function of tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fmp._records import register, static, with_leaves
from fmp.float8._cast import scale_from
from fmp.float8._recipe import Recipe, fp8_max

#: The rows of a record: which cast each amax and scale belongs to.
ROWS = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True, eq=False)
class Float8LinearScales:
    """The scales of one float8 linear layer and the amax history they come from.

    Build one with :meth:`create` (or all of a model's with :func:`fmp.float8.init`).

    Attributes:
        amax_history: float32 ``[3, history]``, one row per cast (:data:`ROWS`: input,
            weight, grad output); column 0 is the newest step's amax.
        scale: float32 ``[3]``, the scale each cast multiplies by before rounding
            (``x_fp8 = saturate(x * scale)``; the matmul divides it out).
        scaling: ``"dynamic"`` or ``"delayed"`` (static: part of the tree structure).
        margin: the recipe's margin (static).
        fwd_format: the recipe's forward format (static).
        bwd_format: the recipe's backward format (static).

    Example:
        >>> r = Float8LinearScales.create(fmp.float8.Recipe("delayed", history=2))
        >>> r = r.update(torch.tensor([2.0, 4.0, 8.0]))
        >>> r.scale
        tensor([ 224.,  112., 7168.])
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    scaling: str = static("delayed")
    margin: float = static(0)
    fwd_format: str = static("e4m3")
    bwd_format: str = static("e5m2")

    @classmethod
    def create(cls, recipe: Recipe, device: torch.device | str | None = None
               ) -> Float8LinearScales:
        """A fresh record: zero history, scales 1 (Transformer Engine starts so too).

        Args:
            recipe: the :class:`fmp.float8.Recipe`.
            device: where its tensors live (None: the CPU).

        Returns:
            The record.

        Raises:
            TypeError: ``recipe`` is not a Recipe.

        Example:
            >>> Float8LinearScales.create(fmp.float8.Recipe(history=3)).amax_history.shape
            torch.Size([3, 3])
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(f"Float8LinearScales.create needs an fmp.float8.Recipe, got "
                            f"{type(recipe).__name__}")
        return cls(amax_history=torch.zeros(3, recipe.history, dtype=torch.float32,
                                            device=device),
                   scale=torch.ones(3, dtype=torch.float32, device=device),
                   scaling=recipe.scaling, margin=recipe.margin,
                   fwd_format=recipe.fwd_format, bwd_format=recipe.bwd_format)

    @property
    def delayed(self) -> bool:
        """Whether the layer's casts read this record (delayed scaling)."""
        return self.scaling == "delayed"

    @property
    def history(self) -> int:
        """The amax history length."""
        return int(self.amax_history.shape[-1])

    def fp8_maxes(self) -> torch.Tensor:
        """float32 ``[3]``: the largest finite value of each row's format.

        Built by fills on the record's device, never copied from the host: a host-to-device
        copy cannot be captured in a CUDA graph.
        """
        f, b = fp8_max(self.fwd_format), fp8_max(self.bwd_format)
        s = self.scale
        return torch.cat([s.new_full((2,), f, dtype=torch.float32),
                          s.new_full((1,), b, dtype=torch.float32)])

    def update(self, amaxes: torch.Tensor) -> Float8LinearScales:
        """The record after one step whose casts saw ``amaxes`` (pure; no host sync).

        Delayed scaling: the history shifts by one step (the oldest column drops out),
        ``amaxes`` becomes column 0, and each row's scale becomes
        ``fp8_max / max(row of the history) / 2**margin``, except where that max is 0,
        inf or NaN or the result is not finite: that row keeps its old scale. Dynamic
        scaling: ``self`` (nothing is recorded).

        Args:
            amaxes: float32 ``[3]``, this step's amax of the input, weight, grad output.

        Returns:
            A new record (``self`` for dynamic scaling).

        Example:
            >>> r = Float8LinearScales.create(fmp.float8.Recipe("delayed", history=2,
            ...                                                  margin=1))
            >>> r.update(torch.tensor([1.0, 0.0, float("inf")])).scale
            tensor([224.,   1.,   1.])
        """
        if not self.delayed:
            return self
        amaxes = amaxes.to(torch.float32)
        hist = torch.cat([amaxes.reshape(3, 1), self.amax_history[:, :-1]], dim=1)
        top = hist.amax(dim=1)
        scale = scale_from(top, self.fp8_maxes(), self.margin, self.scale)
        return with_leaves(self, [hist, scale])

    def to(self, device: torch.device | str) -> Float8LinearScales:
        """The record with its tensors on ``device`` (``self`` if they are there)."""
        h, s = self.amax_history.to(device), self.scale.to(device)
        return self if h is self.amax_history and s is self.scale else with_leaves(self, [h, s])

    def state_dict(self) -> dict[str, Any]:
        """The record as a dict of its two tensors (its own, no copy) and its recipe fields.

        Example:
            >>> sorted(Float8LinearScales.create(fmp.float8.Recipe()).state_dict())
            ['amax_history', 'bwd_format', 'fwd_format', 'margin', 'scale', 'scaling']
        """
        return {"amax_history": self.amax_history, "scale": self.scale,
                "scaling": self.scaling, "margin": self.margin,
                "fwd_format": self.fwd_format, "bwd_format": self.bwd_format}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> Float8LinearScales:
        """Rebuild a record from :meth:`state_dict` (its tensors as they are: exact).

        Raises:
            ValueError: a field is missing, the recipe fields are invalid, or the tensors
                are not float32 ``[3, history]`` and ``[3]``.

        Example:
            >>> r = Float8LinearScales.create(fmp.float8.Recipe("delayed"))
            >>> Float8LinearScales.from_state_dict(r.state_dict()).scale is r.scale
            True
        """
        missing = [k for k in ("amax_history", "scale", "scaling", "margin", "fwd_format",
                               "bwd_format") if k not in d]
        if missing:
            raise ValueError(f"Float8LinearScales.from_state_dict: missing {missing}")
        h, s = d["amax_history"], d["scale"]
        ok = (isinstance(h, torch.Tensor) and isinstance(s, torch.Tensor)
              and h.dtype == s.dtype == torch.float32 and h.dim() == 2 and h.shape[0] == 3
              and h.shape[1] >= 1 and tuple(s.shape) == (3,))
        if not ok:
            raise ValueError("Float8LinearScales.from_state_dict: amax_history must be "
                             "float32 [3, history >= 1] and scale float32 [3], got "
                             f"{_describe(h)} and {_describe(s)}")
        Recipe(d["scaling"], int(h.shape[1]), d["margin"], d["fwd_format"], d["bwd_format"])
        return cls(amax_history=h, scale=s, scaling=d["scaling"], margin=d["margin"],
                   fwd_format=d["fwd_format"], bwd_format=d["bwd_format"])


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)}"
    return type(x).__name__


Float8LinearScales.__module__ = "fmp.float8"  # its public home: pickles and treespecs name it
register(Float8LinearScales)
