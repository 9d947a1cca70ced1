"""Loss scales: immutable records that scale losses, unscale gradients and adjust themselves.

Three frozen dataclasses share one interface:

- :class:`NoOpLossScale`: scale 1, every method is the identity.
- :class:`StaticLossScale`: a fixed scale.
- :class:`DynamicLossScale`: grows after ``period`` clean steps, shrinks on overflow.

Each record is a pytree node, registered with optree (in the global namespace, so plain
``optree.tree_map`` sees inside) and with torch's pytree (so ``torch.func`` transforms and
``torch.compile(fullgraph=True)`` see inside). The leaves are only the tensors that change
from step to step; the hyper-parameters (``period``, ``factor``, ``min_scale``,
``max_scale``, ``hysteresis``) are Python numbers carried in the flatten context, so they
survive every flatten/unflatten, transform and compilation unchanged (jmp loses its
``min_loss_scale`` under ``jit``: not here).

The scale is always a 0-d float32 tensor, whatever the compute dtype, and ``adjust`` is
branch-free (``torch.where``): it never synchronises the host.

The default :class:`DynamicLossScale` (``hysteresis=1``) follows the trajectory of
``torch.amp.GradScaler`` (``torch._amp_update_scale_``) step by step: the growth and the
back-off are computed like torch's kernel does, as the float32 scale times a double
factor rounded once to float32, so the values agree bit for bit for any ``factor``. The
only differences are the bounds: growth is capped at ``max_scale`` (torch instead keeps
the old scale when the grown one would be inf) and the back-off is floored at
``min_scale`` (torch has no floor).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import optree
import torch
import torch.utils._pytree as _torch_pytree

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "loss_scale_from_state_dict",
]

T = TypeVar("T")

_GLOBAL_NAMESPACE: str = getattr(optree.registry, "__GLOBAL_NAMESPACE")
_INT32_MAX = 2**31 - 1
_LOW_PRECISION_ITEMSIZE = 4  # floating dtypes narrower than float32 are computed in float32


# --------------------------------------------------------------------------------------
# Validation helpers (Python numbers only; never called on the adjust path)
# --------------------------------------------------------------------------------------


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (inf where it is out of float32 range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _real(value: Any, name: str) -> float:
    """``value`` as a Python float; ValueError unless it is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _positive_f32(value: Any, name: str) -> float:
    """A Python real that is finite and positive, also once rounded to float32."""
    x = _real(value, name)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if _f32(x) == 0.0 or not math.isfinite(_f32(x)):
        raise ValueError(
            f"{name} must be representable as a positive finite float32 "
            f"(about 1.4e-45 to 3.4e38), got {value!r}"
        )
    return x


def _int_in(value: Any, name: str, low: int, high: int = _INT32_MAX) -> int:
    """A Python integer (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    v = int(value)
    if not low <= v <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return v


def _check_hyper_parameters(
    period: Any, factor: Any, min_scale: Any, max_scale: Any, hysteresis: Any
) -> tuple[int, float, float, float, int]:
    """Validate and normalise the hyper-parameters of a :class:`DynamicLossScale`."""
    period = _int_in(period, "period", 1)
    factor_f = _real(factor, "factor")
    if not math.isfinite(factor_f) or factor_f <= 1.0:
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    min_f = _positive_f32(min_scale, "min_scale")
    max_f = _positive_f32(max_scale, "max_scale")
    if _f32(min_f) > _f32(max_f):
        raise ValueError(
            f"min_scale must be <= max_scale, got min_scale={min_scale!r} > "
            f"max_scale={max_scale!r}"
        )
    hysteresis = _int_in(hysteresis, "hysteresis", 1)
    return period, factor_f, min_f, max_f, hysteresis


def _check_in_bounds(scale: float, min_scale: float, max_scale: float, what: str) -> None:
    """ValueError unless ``scale`` lies in ``[min_scale, max_scale]`` (as float32 values)."""
    if not _f32(min_scale) <= _f32(scale) <= _f32(max_scale):
        raise ValueError(
            f"{what} must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
            f"got {scale!r}; change the bounds or the scale (it is not clamped)"
        )


def _is_concrete(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value is free: a plain CPU tensor outside any tracing.

    Values of device tensors are not read at construction (that would synchronise the
    host), nor of tensors being traced by torch.compile or wrapped by torch.func.
    """
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _scalar_tensor(
    value: Any, dtype: torch.dtype, name: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """``value`` (a Python number or a one-element tensor) as a 0-d tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a 0-d (one-element) tensor, got shape {tuple(value.shape)}"
            )
        wanted = "real" if dtype.is_floating_point else "integer"
        if (value.is_complex() or value.dtype == torch.bool
                or (value.is_floating_point() and not dtype.is_floating_point)):
            raise ValueError(f"{name} must be a one-element {wanted} tensor, got dtype "
                             f"{value.dtype}")
        t = value.detach().reshape(()).to(dtype)
        return t if device is None else t.to(device)
    return torch.tensor(value, dtype=dtype, device=device)


def _as_finite_flag(grads_finite: Any, device: torch.device) -> torch.Tensor:
    """The ``grads_finite`` argument of ``adjust`` as a 0-d bool tensor."""
    if isinstance(grads_finite, bool):
        return torch.tensor(grads_finite, device=device)
    if not isinstance(grads_finite, torch.Tensor):
        raise ValueError(
            f"adjust needs a 0-d bool tensor (e.g. fmp.all_finite(grads)), got "
            f"{type(grads_finite).__name__}"
        )
    if grads_finite.dtype != torch.bool or grads_finite.dim() != 0:
        raise ValueError(
            f"adjust needs a 0-d bool tensor (e.g. fmp.all_finite(grads)), got a tensor of "
            f"dtype {grads_finite.dtype} and shape {tuple(grads_finite.shape)}"
        )
    return grads_finite


def _wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype the growth/back-off product is computed in before rounding to float32.

    torch's ``_amp_update_scale_`` multiplies the float32 scale by a double factor and
    rounds the double product to float32; computing in float64 reproduces that exactly.
    MPS has no float64, so there the product is computed in float32.
    """
    return torch.float32 if device.type == "mps" else torch.float64


def _check_state_dict(d: Any, cls_name: str, keys: tuple[str, ...]) -> None:
    """ValueError unless ``d`` is a mapping with exactly ``keys`` and ``type == cls_name``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls_name}.from_state_dict needs a dict, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    unknown = [k for k in d if k not in keys]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unknown:
            parts.append(f"unknown keys {unknown}")
        raise ValueError(
            f"{cls_name}.from_state_dict: {' and '.join(parts)}; expected exactly "
            f"{list(keys)}"
        )
    if d["type"] != cls_name:
        raise ValueError(
            f"{cls_name}.from_state_dict: the state dict is of type {d['type']!r}, "
            f"not {cls_name!r} (fmp.loss_scale_from_state_dict dispatches on it)"
        )


def _number(value: Any, name: str) -> Any:
    """A state-dict value as a Python number (a one-element tensor is read, on the host)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return value.item()
    return value


# --------------------------------------------------------------------------------------
# Scaling helpers
# --------------------------------------------------------------------------------------


def _is_low_precision(x: torch.Tensor) -> bool:
    return x.dtype.itemsize < _LOW_PRECISION_ITEMSIZE


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def _scale_tree(tree: T, scale: torch.Tensor) -> T:
    """Multiply every floating tensor leaf by ``scale``; narrow floats are promoted to f32."""
    leaves, spec = optree.tree_flatten(tree)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            s = _on(scale, x.device)
            out.append((x.to(torch.float32) if _is_low_precision(x) else x) * s)
        else:
            out.append(x)
    return optree.tree_unflatten(spec, out)


def _unscale_tree(tree: T, scale: torch.Tensor) -> T:
    """Multiply every floating tensor leaf by ``1/scale`` (f32), keeping each leaf's dtype."""
    leaves, spec = optree.tree_flatten(tree)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            groups.setdefault((x.device, x.dtype), []).append(i)
    if not groups:
        return tree
    inv = torch.reciprocal(scale)  # float32
    out = list(leaves)
    for (device, dtype), idx in groups.items():
        inv_d = _on(inv, device)
        xs = [leaves[i] for i in idx]
        if dtype.itemsize < _LOW_PRECISION_ITEMSIZE:
            # On CUDA a float32 0-d tensor times a bf16/fp16 tensor is rounded to the
            # narrow dtype first (1/2**25 is 0 in fp16); multiply in float32 instead.
            ys = [x.to(torch.float32) for x in xs]
            torch._foreach_mul_(ys, inv_d)
            ys = [y.to(dtype) for y in ys]
        else:
            ys = torch._foreach_mul(xs, inv_d)
        for i, y in zip(idx, ys, strict=True):
            out[i] = y
    return optree.tree_unflatten(spec, out)


# --------------------------------------------------------------------------------------
# The records
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class NoOpLossScale:
    """No loss scaling: the scale is 1 and every method is the identity.

    The record has no leaves. ``==`` is identity (records are compared by their fields
    with :meth:`state_dict`).

    Example:
        >>> ls = fmp.NoOpLossScale()
        >>> g = {"w": torch.ones(2)}
        >>> ls.unscale(g) is g
        True
    """

    def __init__(self) -> None:
        """Create the record.

        Example:
            >>> fmp.NoOpLossScale().loss_scale
            tensor(1.)
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

    def unscale(self, tree: T) -> T:
        """Return ``tree`` itself, unchanged.

        Args:
            tree: any pytree (usually the gradients).

        Returns:
            The same object.

        Example:
            >>> g = {"w": torch.ones(2)}
            >>> fmp.NoOpLossScale().unscale(g) is g
            True
        """
        return tree

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
        _check_state_dict(d, cls.__name__, ("type",))
        return cls()


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale:
    """A fixed loss scale.

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

    def __init__(
        self, loss_scale: float | torch.Tensor, device: torch.device | str | None = None
    ) -> None:
        """Create the record.

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
        if isinstance(loss_scale, torch.Tensor):
            t = _scalar_tensor(loss_scale, torch.float32, "loss_scale", device)
            if _is_concrete(t):
                v = t.item()
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(
                        f"loss_scale must be a finite float32 > 0, got {loss_scale!r}"
                    )
        else:
            _positive_f32(loss_scale, "loss_scale")
            t = torch.tensor(float(loss_scale), dtype=torch.float32, device=device)
        object.__setattr__(self, "loss_scale", t)

    @classmethod
    def _make(cls, loss_scale: Any) -> StaticLossScale:
        """Build the record from a leaf without any check (for unflatten and transforms)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "loss_scale", loss_scale)
        return obj

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
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Multiply every floating-point tensor leaf of ``tree`` by the reciprocal scale.

        The reciprocal is computed in float32 and each product in float32 (narrow leaves
        are widened for the multiplication), then rounded to the leaf's own dtype, which
        is kept. Leaves are multiplied in groups per device and dtype with
        ``torch._foreach_mul``. Non-floating leaves pass through; the input is not
        modified.

        Args:
            tree: any pytree, usually the gradients.

        Returns:
            A new tree of the same structure and dtypes (the same object if it has no
            floating leaves).

        Example:
            >>> fmp.StaticLossScale(4.0).unscale([torch.tensor([8.0]), torch.tensor([3])])
            [tensor([2.]), tensor([3])]
        """
        return _unscale_tree(tree, self.loss_scale)

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
        return self if t is self.loss_scale else type(self)._make(t)

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
        _check_state_dict(d, cls.__name__, ("type", "loss_scale"))
        return cls(_number(d["loss_scale"], "loss_scale"), device=device)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale:
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
    counter: torch.Tensor
    overflows: torch.Tensor
    period: int
    factor: float
    min_scale: float
    max_scale: float
    hysteresis: int

    _LEAVES: ClassVar[tuple[str, ...]] = ("loss_scale", "counter", "overflows")
    _META: ClassVar[tuple[str, ...]] = ("period", "factor", "min_scale", "max_scale",
                                        "hysteresis")

    def __init__(
        self,
        loss_scale: float | torch.Tensor,
        counter: int | torch.Tensor = 0,
        overflows: int | torch.Tensor = 0,
        period: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
    ) -> None:
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
        period, factor, min_scale, max_scale, hysteresis = _check_hyper_parameters(
            period, factor, min_scale, max_scale, hysteresis
        )
        if isinstance(loss_scale, torch.Tensor):
            scale_t = _scalar_tensor(loss_scale, torch.float32, "loss_scale")
        else:
            _positive_f32(loss_scale, "loss_scale")
            scale_t = torch.tensor(float(loss_scale), dtype=torch.float32)
        device = scale_t.device
        counter_t = _scalar_tensor(counter, torch.int32, "counter", device)
        overflows_t = _scalar_tensor(overflows, torch.int32, "overflows", device)
        if not isinstance(counter, torch.Tensor):
            _int_in(counter, "counter", 0, period - 1)
        if not isinstance(overflows, torch.Tensor):
            _int_in(overflows, "overflows", 0, hysteresis - 1)
        if _is_concrete(scale_t):
            v = scale_t.item()
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"loss_scale must be a finite float32 > 0, got {loss_scale!r}")
            _check_in_bounds(v, min_scale, max_scale, "loss_scale")
        if _is_concrete(counter_t):
            _int_in(counter_t.item(), "counter", 0, period - 1)
        if _is_concrete(overflows_t):
            _int_in(overflows_t.item(), "overflows", 0, hysteresis - 1)
        for name, value in zip(
            self._LEAVES + self._META,
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
        period, factor, min_scale, max_scale, hysteresis = _check_hyper_parameters(
            period, factor, min_scale, max_scale, hysteresis
        )
        initial_f = _positive_f32(initial, "initial")
        _check_in_bounds(initial_f, min_scale, max_scale, "initial")
        return cls._make(
            torch.tensor(initial_f, dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
            (period, factor, min_scale, max_scale, hysteresis),
        )

    @classmethod
    def _make(
        cls,
        loss_scale: Any,
        counter: Any,
        overflows: Any,
        meta: tuple[int, float, float, float, int],
    ) -> DynamicLossScale:
        """Build the record without any check (for unflatten, adjust and transforms)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "loss_scale", loss_scale)
        object.__setattr__(obj, "counter", counter)
        object.__setattr__(obj, "overflows", overflows)
        object.__setattr__(obj, "period", meta[0])
        object.__setattr__(obj, "factor", meta[1])
        object.__setattr__(obj, "min_scale", meta[2])
        object.__setattr__(obj, "max_scale", meta[3])
        object.__setattr__(obj, "hysteresis", meta[4])
        return obj

    @property
    def _meta(self) -> tuple[int, float, float, float, int]:
        return (self.period, self.factor, self.min_scale, self.max_scale, self.hysteresis)

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
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Multiply every floating-point tensor leaf of ``tree`` by ``1/scale``.

        Same rules as :meth:`StaticLossScale.unscale`: reciprocal and products in
        float32, each leaf's dtype kept, ``torch._foreach_mul`` per device and dtype.

        Args:
            tree: any pytree, usually the gradients.

        Returns:
            A new tree of the same structure and dtypes.

        Example:
            >>> fmp.DynamicLossScale.create(initial=8.0).unscale({"w": torch.tensor([4.0])})
            {'w': tensor([0.5000])}
        """
        return _unscale_tree(tree, self.loss_scale)

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
        finite = _as_finite_flag(grads_finite, scale.device)
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
        return type(self)._make(new_scale, new_counter, new_overflows, self._meta)

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
        return type(self)._make(
            self.loss_scale.to(device), self.counter.to(device), self.overflows.to(device),
            self._meta,
        )

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
        _check_state_dict(d, cls.__name__, ("type", *cls._LEAVES, *cls._META))
        scale = _number(d["loss_scale"], "loss_scale")
        out = cls(
            scale,
            _number(d["counter"], "counter"),
            _number(d["overflows"], "overflows"),
            period=d["period"],
            factor=d["factor"],
            min_scale=d["min_scale"],
            max_scale=d["max_scale"],
            hysteresis=d["hysteresis"],
        )
        return out if device is None else out.to(device)


#: Any of the three loss-scale records (for annotations).
LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

_CLASSES: dict[str, type[NoOpLossScale] | type[StaticLossScale] | type[DynamicLossScale]] = {
    c.__name__: c for c in (NoOpLossScale, StaticLossScale, DynamicLossScale)
}


def loss_scale_from_state_dict(
    d: Mapping[str, Any], device: torch.device | str | None = None
) -> LossScale:
    """Rebuild any loss-scale record from its ``state_dict()``, dispatching on ``d["type"]``.

    Args:
        d: the output of one of the records' ``state_dict()``.
        device: where to put the tensors (default: the CPU).

    Returns:
        A :class:`NoOpLossScale`, :class:`StaticLossScale` or :class:`DynamicLossScale`.

    Raises:
        ValueError: ``d`` is not a dict, has no known ``type``, or the class's
            ``from_state_dict`` rejects it.

    Example:
        >>> fmp.loss_scale.loss_scale_from_state_dict({"type": "NoOpLossScale"})
        NoOpLossScale()
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"loss_scale_from_state_dict needs a dict, got {type(d).__name__}")
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _CLASSES:
        raise ValueError(
            f"unknown loss-scale type {kind!r} in the state dict; accepted: "
            f"{', '.join(_CLASSES)}"
        )
    return _CLASSES[kind].from_state_dict(d, device=device)


# --------------------------------------------------------------------------------------
# Pytree registration (optree global namespace, and torch's pytree)
# --------------------------------------------------------------------------------------


def _register() -> None:
    gak = _torch_pytree.GetAttrKey

    # NoOpLossScale: no leaves.
    optree.register_pytree_node(
        NoOpLossScale,
        lambda ls: ((), None, ()),
        lambda meta, children: NoOpLossScale(),
        path_entry_type=optree.GetAttrEntry,
        namespace=_GLOBAL_NAMESPACE,
    )
    _torch_pytree.register_pytree_node(
        NoOpLossScale,
        lambda ls: ([], None),
        lambda children, ctx: NoOpLossScale(),
        serialized_type_name="fmp.loss_scale.NoOpLossScale",
        flatten_with_keys_fn=lambda ls: ([], None),
    )

    # StaticLossScale: one leaf, no metadata.
    optree.register_pytree_node(
        StaticLossScale,
        lambda ls: ((ls.loss_scale,), None, ("loss_scale",)),
        lambda meta, children: StaticLossScale._make(*children),
        path_entry_type=optree.GetAttrEntry,
        namespace=_GLOBAL_NAMESPACE,
    )
    _torch_pytree.register_pytree_node(
        StaticLossScale,
        lambda ls: ([ls.loss_scale], None),
        lambda children, ctx: StaticLossScale._make(*children),
        serialized_type_name="fmp.loss_scale.StaticLossScale",
        flatten_with_keys_fn=lambda ls: ([(gak("loss_scale"), ls.loss_scale)], None),
    )

    # DynamicLossScale: three leaves; the hyper-parameters are the context.
    def flatten(ls: DynamicLossScale) -> tuple[list[Any], tuple[Any, ...]]:
        return [ls.loss_scale, ls.counter, ls.overflows], ls._meta

    def unflatten(children: Any, meta: Any) -> DynamicLossScale:
        return DynamicLossScale._make(*children, tuple(meta))

    optree.register_pytree_node(
        DynamicLossScale,
        lambda ls: (*flatten(ls), DynamicLossScale._LEAVES),
        lambda meta, children: unflatten(children, meta),
        path_entry_type=optree.GetAttrEntry,
        namespace=_GLOBAL_NAMESPACE,
    )
    _torch_pytree.register_pytree_node(
        DynamicLossScale,
        flatten,
        unflatten,
        serialized_type_name="fmp.loss_scale.DynamicLossScale",
        to_dumpable_context=list,
        from_dumpable_context=tuple,
        flatten_with_keys_fn=lambda ls: (
            [(gak(n), getattr(ls, n)) for n in DynamicLossScale._LEAVES], ls._meta
        ),
    )


_register()
