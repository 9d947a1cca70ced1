"""Opt levels: Apex's presets O0-O3 plus the bfloat16 levels O4/O5, and keyword overrides.

The preset is applied first, then every keyword that is not None overrides it, and the
combination is checked the way Apex checked it (O1 with master weights, O1 with a cast
model type, ``patch_torch_functions`` outside O1/O4 ... are errors).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch

import fmp
from adapters.apex.amp._errors import AmpError

_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved settings of one ``initialize`` call.

    Attributes:
        opt_level: ``"O0"`` ... ``"O5"``.
        cast_model_type: the dtype the model is cast to, or None (not cast).
        patch_torch_functions: O1/O4: run the forward under ``torch.autocast``.
        autocast_dtype: the low dtype autocast computes in (float16 for O1, bfloat16 O4).
        keep_batchnorm_fp32: keep batch-norm layers in float32 when casting the model.
        master_weights: keep float32 master copies of low-precision params.
        loss_scale: ``"dynamic"`` or a positive float.
        cast_model_outputs: the dtype model outputs are cast to, or None.

    Example:
        >>> resolve_properties("O2").master_weights
        True
    """

    opt_level: str
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    autocast_dtype: torch.dtype
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: str | float
    cast_model_outputs: torch.dtype | None

    def describe(self) -> str:
        """A one-line summary for the log."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


#: The presets (Apex's table, plus O4 = bfloat16 O1-style, O5 = bfloat16 O2-style).
OPT_LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=_F32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0, autocast_dtype=_F16),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic", autocast_dtype=_F16),
    "O2": dict(cast_model_type=_F16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic", autocast_dtype=_F16),
    "O3": dict(cast_model_type=_F16, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0, autocast_dtype=_F16),
    "O4": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale=1.0, autocast_dtype=_BF16),
    "O5": dict(cast_model_type=_BF16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale=1.0, autocast_dtype=_BF16),
}
_O1_STYLE = ("O1", "O4")


def _bool_or_str(value: Any, name: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise AmpError(f"{name} must be a boolean, the string 'True' or 'False', or None, "
                   f"found {name}={value!r}")


def _dtype_or_none(value: Any, name: str) -> torch.dtype | None:
    if value is None or value is False:
        return None
    try:
        return fmp.dtype(value)
    except ValueError as e:
        raise AmpError(f"{name}={value!r} is not a dtype: {e}") from None


def _loss_scale(value: Any) -> str | float:
    if value == "dynamic":
        return "dynamic"
    try:
        if isinstance(value, bool):
            raise TypeError
        f = float(value) if isinstance(value, numbers.Real | str) else float("nan")
    except (TypeError, ValueError):
        f = float("nan")
    if not math.isfinite(f) or f <= 0:
        raise AmpError(f"loss_scale must be 'dynamic' or a positive finite number, "
                       f"got {value!r}")
    return f


def resolve_properties(
    opt_level: str,
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
) -> Properties:
    """The preset of ``opt_level`` with the keywords that are not None applied over it.

    Args:
        opt_level: ``"O0"`` to ``"O5"`` (the letter O, then a digit).
        cast_model_type: dtype (or name) to cast the model to; ``False`` means no cast.
        patch_torch_functions: O1/O4 only: autocast the forward.
        keep_batchnorm_fp32: bool or ``"True"``/``"False"``; not with O1/O4.
        master_weights: bool; not with O1/O4.
        loss_scale: ``"dynamic"`` or a positive number.
        cast_model_outputs: dtype (or name) for the model's floating outputs.

    Returns:
        The resolved :class:`Properties`.

    Raises:
        AmpError: unknown opt level (the valid ones are listed), or a combination Apex
            rejected.

    Example:
        >>> resolve_properties("O1", loss_scale=128).loss_scale
        128.0
    """
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        hint = ""
        if isinstance(opt_level, str) and opt_level.upper() in OPT_LEVELS:
            hint = f" (did you mean {opt_level.upper()!r}?)"
        elif isinstance(opt_level, str) and opt_level[:1] == "0":
            hint = " (the prefix is the letter O, not the number zero)"
        raise AmpError(f"unknown opt_level {opt_level!r}{hint}; valid opt levels are "
                       f"{', '.join(repr(k) for k in OPT_LEVELS)}")
    o1 = opt_level in _O1_STYLE
    p = dict(OPT_LEVELS[opt_level])
    cmt = _dtype_or_none(cast_model_type, "cast_model_type")
    if cast_model_type is not None:
        if o1 and cmt not in (None, _F32):
            raise AmpError(
                f"{opt_level} inserts casts around torch functions rather than casting model "
                f"weights, so the model weights should stay float32 (got cast_model_type="
                f"{cast_model_type!r}); to cast the model use opt_level 'O2' or 'O3'")
        p["cast_model_type"] = cmt
    if o1 and p["cast_model_type"] == _F32:
        p["cast_model_type"] = None
    if patch_torch_functions is not None:
        ptf = _bool_or_str(patch_torch_functions, "patch_torch_functions")
        if ptf and not o1:
            raise AmpError("patch_torch_functions=True is only valid with opt_level 'O1' or "
                           f"'O4' (got opt_level {opt_level!r})")
        p["patch_torch_functions"] = bool(ptf)
    if keep_batchnorm_fp32 is not None:
        kb = _bool_or_str(keep_batchnorm_fp32, "keep_batchnorm_fp32")
        if o1:
            raise AmpError(
                f"with opt_level {opt_level}, batch-norm already runs in float32 under "
                f"autocast, so keep_batchnorm_fp32 should be None (got {keep_batchnorm_fp32!r})")
        p["keep_batchnorm_fp32"] = kb
    if master_weights is not None:
        if o1:
            raise AmpError(
                f"master_weights make no sense with opt_level {opt_level}: its model weights "
                f"are float32 already (got master_weights={master_weights!r})")
        if not isinstance(master_weights, bool):
            raise AmpError(f"master_weights must be a bool or None, got {master_weights!r}")
        p["master_weights"] = master_weights
    if loss_scale is not None:
        p["loss_scale"] = _loss_scale(loss_scale)
    return Properties(
        opt_level=opt_level,
        cast_model_type=p["cast_model_type"],
        patch_torch_functions=bool(p["patch_torch_functions"]),
        autocast_dtype=p["autocast_dtype"],
        keep_batchnorm_fp32=p["keep_batchnorm_fp32"],
        master_weights=bool(p["master_weights"]),
        loss_scale=p["loss_scale"],
        cast_model_outputs=_dtype_or_none(cast_model_outputs, "cast_model_outputs"),
    )
