"""Mixed-precision policies: which dtype params are stored, computed and returned in."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping
from typing import Any, Literal, NoReturn, TypeVar

import torch

from fmp.dtypes import DTYPE_NAMES, dtype_name
from fmp.dtypes import dtype as _dtype
from fmp.tree import cast_tree

__all__ = ["NORM_LAYERS", "PRESETS", "Policy", "cast_params", "get_policy", "module_policies"]

T = TypeVar("T")

_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
         "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Three dtypes: how params are stored, how they are computed with, what comes out.

    The fields accept ``torch.dtype`` objects or names (``"bf16"``, ``"float32"``, ...);
    they are stored as ``torch.dtype``.

    Args:
        param_dtype: the dtype params (and optimizer updates) are kept in.
        compute_dtype: the dtype params and floating inputs are cast to for the forward.
        output_dtype: the dtype outputs are cast to by :meth:`cast_to_output`.

    Raises:
        ValueError: a dtype is not accepted by :func:`fmp.dtype`.

    Example:
        >>> p = fmp.Policy(torch.float32, "bf16", torch.float32)
        >>> str(p)
        'params=float32,compute=bfloat16,output=float32'
        >>> fmp.get_policy(str(p)) == p
        True
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _dtype(getattr(self, f.name)))

    def cast_to_param(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to :attr:`param_dtype` (:func:`fmp.cast_tree`)."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to :attr:`compute_dtype`."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Cast the floating leaves of ``tree`` to :attr:`output_dtype`."""
        return cast_tree(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: str | torch.dtype) -> Policy:
        """A copy of this policy with another output dtype.

        Example:
            >>> fmp.get_policy("bf16-true").with_output_dtype("f32").output_dtype
            torch.float32
        """
        return dataclasses.replace(self, output_dtype=_dtype(output_dtype))

    @property
    def is_mixed(self) -> bool:
        """True when the compute dtype differs from the param dtype."""
        return self.compute_dtype != self.param_dtype

    def __str__(self) -> str:
        return (f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
                f"output={dtype_name(self.output_dtype)}")


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16


class _Presets(Mapping[str, Policy]):
    """The named policies, read-only: a change would alter every later ``get_policy``."""

    __slots__ = ("_table",)

    def __init__(self, table: dict[str, Policy]) -> None:
        self._table = dict(table)

    def __getitem__(self, name: str) -> Policy:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"PRESETS({self._table!r})"

    def copy(self) -> dict[str, Policy]:
        """A plain (mutable) dict of the presets."""
        return dict(self._table)

    def _read_only(self, *_: Any, **__: Any) -> NoReturn:
        raise TypeError("fmp.PRESETS is read-only (every get_policy call reads it); build "
                        "your own policy with fmp.Policy(...) or fmp.get_policy('p=f32,c=bf16"
                        ",o=f32') and pass it where a policy spec is accepted")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only


#: Named policies (read-only). Apex's O1 and O2 both keep float32 params (O2's "master
#: weights") and compute in float16; O1's op-level cast lists are ``autocast=True`` in the
#: train step. O4 and O5 are the bfloat16 counterparts of O1 and O2 (as in the Apex adapter).
PRESETS: Mapping[str, Policy] = _Presets({
    "fp32": Policy(_F32, _F32, _F32),
    "bf16-mixed": Policy(_F32, _BF16, _F32),
    "fp16-mixed": Policy(_F32, _F16, _F32),
    "bf16-true": Policy(_BF16, _BF16, _BF16),
    "fp16-true": Policy(_F16, _F16, _F16),
    "o0": Policy(_F32, _F32, _F32),
    "o1": Policy(_F32, _F16, _F32),
    "o2": Policy(_F32, _F16, _F32),
    "o3": Policy(_F16, _F16, _F16),
    "o4": Policy(_F32, _BF16, _F32),
    "o5": Policy(_F32, _BF16, _F32),
})

_ACCEPTED = (
    "a preset (" + ", ".join(k if not k.startswith("o") else k.upper() for k in PRESETS) + "), "
    "a dtype name (" + ", ".join(DTYPE_NAMES) + "), or comma-separated key=dtype parts with "
    "keys p|params, c|compute, o|output"
)


def _parse_dtype(text: str, part: str, spec: str) -> torch.dtype:
    try:
        return _dtype(text)
    except ValueError:
        raise ValueError(
            f"unknown dtype {text.strip()!r} in part {part!r} of policy {spec!r}; "
            f"accepted dtype names: {', '.join(DTYPE_NAMES)}"
        ) from None


def get_policy(spec: str | Policy) -> Policy:
    """Parse a policy string (or pass a :class:`Policy` through).

    Grammar: a preset name, a bare dtype name (sets all three dtypes), or comma-separated
    ``key=dtype`` parts with keys ``p``/``params``, ``c``/``compute``, ``o``/``output``.
    params defaults to float32, compute to params, output to compute. Names are
    case-insensitive and spaces around parts are ignored.

    Args:
        spec: e.g. ``"bf16-mixed"``, ``"O2"``, ``"half"``, ``"p=f32,c=bf16,o=f32"``.

    Returns:
        The :class:`Policy`.

    Raises:
        ValueError: empty spec or part, a part with no or several ``=``, an unknown or
            repeated key, or an unknown dtype. The message quotes the bad part and lists
            what is accepted.

    Example:
        >>> fmp.get_policy("c=bf16")
        Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a policy spec must be a str or Policy, got {type(spec).__name__} "
                         f"{spec!r}; accepted: {_ACCEPTED}")
    text = spec.strip()
    if not text:
        raise ValueError(f"empty policy spec {spec!r}; accepted: {_ACCEPTED}")
    low = text.lower()
    if low in PRESETS:
        return PRESETS[low]
    if "=" not in text and "," not in text:
        try:
            d = _dtype(text)
        except ValueError:
            raise ValueError(f"unknown policy {spec!r}; accepted: {_ACCEPTED}") from None
        return Policy(d, d, d)
    found: dict[str, torch.dtype] = {}
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"empty part in policy {spec!r} (two commas, or a comma at an "
                             f"end); accepted: {_ACCEPTED}")
        pieces = part.split("=")
        if len(pieces) != 2:
            why = "has no '='" if len(pieces) == 1 else "has more than one '='"
            raise ValueError(f"part {part!r} of policy {spec!r} {why}; each part is "
                             f"key=dtype with keys p|params, c|compute, o|output")
        key, value = pieces[0].strip().lower(), pieces[1]
        if key not in _KEYS:
            raise ValueError(f"unknown key {pieces[0].strip()!r} in part {part!r} of policy "
                             f"{spec!r}; accepted keys: p, params, c, compute, o, output")
        field = _KEYS[key]
        if field in found:
            raise ValueError(f"{field.split('_')[0]} dtype given twice in policy {spec!r} "
                             f"(part {part!r})")
        found[field] = _parse_dtype(value, part, spec)
    p = found.get("param_dtype", _F32)
    c = found.get("compute_dtype", p)
    o = found.get("output_dtype", c)
    return Policy(p, c, o)


ModuleKey = type | str

#: The norm layers that mixed policies with float32 params keep in float32 by default (as
#: Apex's ``keep_batchnorm_fp32`` and torch.autocast do): their statistics and affine
#: params lose too much in 16 bits, and BatchNorm's kernels take a float16/bfloat16 input
#: only with float32 params and running statistics.
NORM_LAYERS: tuple[type, ...] = tuple(
    c for c in (getattr(torch.nn, n, None) for n in (
        "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
        "LazyBatchNorm2d", "LazyBatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
        "InstanceNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d",
        "LayerNorm", "GroupNorm", "RMSNorm"))
    if isinstance(c, type))


def keeps_norms_fp32(pol: Policy) -> bool:
    """Whether ``pol`` is mixed with float32 params, so norm layers stay in float32."""
    return pol.param_dtype == _F32 and pol.compute_dtype in (_F16, _BF16)


def norm_policy(pol: Policy) -> Policy | None:
    """The policy norm layers take by default under ``pol`` (None: the same as ``pol``)."""
    return Policy(_F32, _F32, pol.output_dtype) if keeps_norms_fp32(pol) else None


def module_policies(
    model: torch.nn.Module,
    default: str | Policy,
    overrides: Mapping[ModuleKey, str | Policy] | None = None,
    keep_norms_fp32: bool = True,
) -> dict[str, Policy]:
    """A policy for every parameter of ``model``, with per-module overrides.

    Each parameter takes the policy of the module that owns it directly. A module takes
    the first override (in the mapping's order) whose key matches it: a class matches by
    ``isinstance`` (``torch.nn.LayerNorm``, a tuple of classes is not accepted: give one
    key per class), a string matches the module's dotted name with :mod:`fnmatch`
    (``"encoder.*"``, ``"*.norm"``; ``""`` is the root module). Modules no key matches
    take ``default``, except norm layers (:data:`NORM_LAYERS`: BatchNorm, InstanceNorm,
    LayerNorm, GroupNorm, RMSNorm) under a mixed ``default`` with float32 params (the
    mixed presets): those stay in float32 (``Policy(f32, f32, output)``), as with Apex's
    ``keep_batchnorm_fp32`` and torch.autocast. An override that matches a norm layer
    wins (``{torch.nn.LayerNorm: "bf16-mixed"}`` casts LayerNorms again).

    Args:
        model: the module.
        default: the policy (or spec) for parameters no override matches.
        overrides: a mapping from module class or name pattern to policy (or spec).
        keep_norms_fp32: keep unmatched norm layers in float32 under mixed defaults
            (False: they take ``default`` like any other module).

    Returns:
        A dict from parameter name (as in ``model.named_parameters()``) to :class:`Policy`.

    Raises:
        ValueError: a key is neither a class nor a string, or a spec is bad.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> pol = fmp.module_policies(net, "bf16-mixed", {torch.nn.LayerNorm: "fp32"})
        >>> pol["1.weight"].compute_dtype, pol["0.weight"].compute_dtype
        (torch.float32, torch.bfloat16)
    """
    base = get_policy(default)
    rules: list[tuple[ModuleKey, Policy]] = []
    for key, spec in (overrides or {}).items():
        if not isinstance(key, type | str):
            raise ValueError(f"module_policies override key {key!r} must be a module class "
                             f"or an fnmatch pattern string over module names")
        rules.append((key, get_policy(spec)))

    norm = norm_policy(base) if keep_norms_fp32 else None

    def pick(name: str, module: torch.nn.Module) -> Policy:
        for key, pol in rules:
            if isinstance(key, str):
                if fnmatch.fnmatchcase(name, key):
                    return pol
            elif isinstance(module, key):
                return pol
        if norm is not None and isinstance(module, NORM_LAYERS):
            return norm
        return base

    out: dict[str, Policy] = {}
    for mod_name, module in model.named_modules():
        pol = pick(mod_name, module)
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            out[full] = pol
    # Keep exactly the names (and order) of model.named_parameters(): tied weights appear once.
    return {n: out[n] for n, _ in model.named_parameters()}


Which = Literal["param", "compute", "output"]
_WHICH = {"param": "param_dtype", "compute": "compute_dtype", "output": "output_dtype"}


def cast_params(params: Mapping[str, Any], policies: Mapping[str, Policy],
                which: Which) -> dict[str, Any]:
    """Cast a params dict leaf by leaf, each to its own policy's dtype.

    Args:
        params: a dict from parameter name to tensor (e.g. from :func:`fmp.functional`).
        policies: a dict from parameter name to :class:`Policy`, e.g. from
            :func:`module_policies`; it must cover every name in ``params``.
        which: ``"param"``, ``"compute"`` or ``"output"``: which dtype of each policy.

    Returns:
        A new dict; non-floating values pass through, inputs are untouched.

    Raises:
        ValueError: ``which`` is not one of the three, or a name has no policy.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> pol = fmp.module_policies(net, "bf16-mixed", {torch.nn.LayerNorm: "fp32"})
        >>> _, params, _ = fmp.functional(net)
        >>> fmp.cast_params(params, pol, "compute")["0.weight"].dtype
        torch.bfloat16
    """
    if which not in _WHICH:
        raise ValueError(f"which={which!r} is not accepted; use 'param', 'compute' or 'output'")
    missing = [k for k in params if k not in policies]
    if missing:
        raise ValueError(f"no policy for parameter(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; policies cover "
                         f"{len(policies)} names")
    field = _WHICH[which]
    return {k: cast_tree(v, getattr(policies[k], field)) for k, v in params.items()}
