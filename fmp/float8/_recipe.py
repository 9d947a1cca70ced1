"""``fmp.float8.Recipe``: how a float8 linear layer picks its scales (dynamic or delayed)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

#: The float8 formats by name: e4m3 (more precision, max 448) and e5m2 (more range, 57344).
FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALINGS = ("dynamic", "delayed")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How :class:`fmp.float8.Float8Linear` scales its float8 casts.

    ``dynamic``: each cast takes its scale from the amax (largest magnitude) of the tensor
    it casts, now. ``delayed`` (Transformer Engine's recipe): the input, weight and
    grad-output casts take their scales from the records in the :class:`fmp.TrainState`,
    ``scale = fp8_max / max(amax_history) / 2**margin``, and each step writes its own
    amaxes into the history (``history`` steps long).

    Attributes:
        scaling: ``"dynamic"`` or ``"delayed"``.
        history: the amax history length of delayed scaling (an int >= 1).
        margin: the scale is divided by ``2**margin`` (a finite number >= 0) for headroom.
        fwd_format: the format of inputs and weights in the forward: ``"e4m3"``.
        bwd_format: the format of grad outputs in the backward: ``"e5m2"`` (default) or
            ``"e4m3"``.

    Raises:
        ValueError: a field outside the values above (the message names it and what is
            accepted).

    Example:
        >>> fmp.float8.Recipe("delayed", history=4).history
        4
        >>> fmp.float8.Recipe("delayed", history=0)
        Traceback (most recent call last):
        ...
        ValueError: Recipe.history must be an int >= 1, got 0
    """

    scaling: str = "dynamic"
    history: int = 16
    margin: float = 0
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        h = self.history
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"Recipe.history must be an int >= 1, got {h!r}")
        m = self.margin
        if (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)
                or m < 0):
            raise ValueError(f"Recipe.margin must be a finite number >= 0, got {m!r}")
        if self.fwd_format != "e4m3":
            raise ValueError(f"Recipe.fwd_format must be 'e4m3' (torch._scaled_mm takes no "
                             f"e5m2 x e5m2 product), got {self.fwd_format!r}")
        if self.bwd_format not in FORMATS:
            raise ValueError(f"Recipe.bwd_format must be one of {tuple(FORMATS)}, got "
                             f"{self.bwd_format!r}")


def as_recipe(recipe: Any) -> Recipe:
    """A :class:`Recipe` from a Recipe or a scaling name (``"dynamic"``, ``"delayed"``).

    Raises:
        ValueError: a string that is not a scaling name.
        TypeError: anything else.

    Example:
        >>> as_recipe("delayed").scaling
        'delayed'
    """
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return Recipe(scaling=recipe)
    raise TypeError(f"a float8 recipe must be an fmp.float8.Recipe or one of {SCALINGS}, got "
                    f"{type(recipe).__name__}")


def fp8_max(fmt: str) -> float:
    """The largest finite value of the float8 format ``fmt`` ("e4m3": 448, "e5m2": 57344)."""
    return float(torch.finfo(FORMATS[fmt]).max)
