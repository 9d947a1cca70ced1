"""Functional optimizers shaped like optax: pure, branch-free, multi-tensor.

A :class:`GradientTransformation` is a pair of pure functions ``init(params) -> state``
and ``update(grads, state, params=None) -> (updates, new_state)``. Updates are deltas to
*add* to the params (:func:`apply_updates`). Nothing here modifies its inputs, calls
``.item()`` or branches on tensor values, so one update traces under
``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph.

:func:`sgd`, :func:`adam` and :func:`adamw` follow the formulas of ``torch.optim.SGD``,
``torch.optim.Adam`` and ``torch.optim.AdamW`` (tested step by step against them).
:func:`chain` composes the building blocks (:func:`add_decayed_weights`, :func:`trace`,
:func:`scale_by_adam`, :func:`scale_by_learning_rate`, :func:`scale`).

Dtypes. Optimizer moments are stored in ``state_dtype`` (float32 by default, also for
bfloat16 / float16 params; ``None`` keeps each param's own dtype as torch.optim does).
The arithmetic of one leaf runs in its *compute dtype*: the promotion of float32, the
grad's dtype and the state dtype (float32 for bf16 / fp16 / fp32 trees, float64 when
either is float64). After each update the moments are cast back to their state dtype,
so dtypes never drift. Updates come back in the compute dtype; :func:`apply_updates`
adds them in the promoted dtype of param and update and casts the sum to the param's
dtype. Scalar step quantities (bias corrections, scheduled learning rates) are 0-d
float32 tensors on the params' device (bias corrections in float64 where a leaf computes
in float64).

Trees. Params, grads, updates and moments are any optree pytree (params dicts, lists,
NamedTuples); None is an empty subtree (optree's default), so a None entry passes
through. Leaves are flattened into lists and updated with ``torch._foreach_*`` ops: one
update is a handful of multi-tensor kernels, not one kernel per tensor. Leaves whose
dtype differs from the compute dtype are cast one by one (under ``torch.compile`` these
casts fuse). All leaves are expected on one device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fmp._fused import FusedSpec
from fmp.dtypes import dtype as _dtype

__all__ = [
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "ScaleByScheduleState",
    "Schedule",
    "SgdState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "schedule_ok",
    "sgd",
    "trace",
]

#: A learning-rate schedule: called with the step count (a 0-d int32 tensor: the number of
#: updates applied before this one) it returns the rate as a 0-d tensor or a Python float.
#: It must not synchronise the host (no ``.item()``) if the update is to be compiled. A
#: rate that comes out inf, NaN or negative is never applied: the update uses 0 and
#: :func:`fmp.train_step` skips the step (:func:`schedule_ok`).
Schedule = Callable[[torch.Tensor], "torch.Tensor | float"]

_INT32_MAX = 2**31 - 1


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init`` builds the state, ``update`` transforms grads.

    Attributes:
        init: ``init(params) -> state``; the state is a NamedTuple of tensors (or a tuple
            of such for :func:`chain`).
        update: ``update(grads, state, params=None) -> (updates, new_state)``. ``updates``
            has the structure of ``grads``; add it to the params with
            :func:`apply_updates`. ``params`` is needed by transformations that use the
            weights (weight decay) and is otherwise ignored.

    Example:
        >>> opt = fmp.optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> fmp.optim.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    #: Set by :func:`sgd`, :func:`adam` and :func:`adamw`: lets ``train_step(donate=True)``
    #: run torch's fused in-place kernel (unscale, update and skip in one pass) where it
    #: computes the same formulas. None for other transformations.
    fused: Any = None
    #: ``schedule_ok(state) -> 0-d bool tensor``: whether the learning rate the next update
    #: reads from its schedule is finite and >= 0 (see :func:`schedule_ok`). None for
    #: transformations without a schedule.
    schedule_ok: Callable[[Any], torch.Tensor] | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation (no leaves).

    Example:
        >>> fmp.optim.scale(0.5).init({"w": torch.ones(2)})
        EmptyState()
    """


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates at the
            int32 maximum).
        momentum: the momentum buffers, a tree like the params in ``state_dtype``, or
            None when ``momentum == 0``.

    Example:
        >>> fmp.optim.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        SgdState(count=tensor(0, dtype=torch.int32), momentum={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    momentum: Any


class AdamState(NamedTuple):
    """State of :func:`adam`, :func:`adamw` and :func:`scale_by_adam`.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).
        mu: first moments (torch's ``exp_avg``), a tree like the params in
            ``state_dtype``.
        nu: second moments (torch's ``exp_avg_sq``), same structure and dtype.
        nu_max: running maximum of ``nu`` (torch's ``max_exp_avg_sq``) when
            ``amsgrad=True``, else None.

    Example:
        >>> fmp.optim.adam().init({"w": torch.ones(2)}).count
        tensor(0, dtype=torch.int32)
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any = None


class TraceState(NamedTuple):
    """State of :func:`trace` (torch-style momentum).

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).
        trace: the momentum buffers, a tree like the params in ``state_dtype``.

    Example:
        >>> fmp.optim.trace(0.9).init({"w": torch.ones(1)}).trace
        {'w': tensor([0.])}
    """

    count: torch.Tensor
    trace: Any


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule.

    Attributes:
        count: 0-d int32 tensor, the number of updates applied so far (saturates).

    Example:
        >>> fmp.optim.scale_by_learning_rate(lambda c: 0.1 * 0.5**c).init({})
        ScaleByScheduleState(count=tensor(0, dtype=torch.int32))
    """

    count: torch.Tensor


# --------------------------------------------------------------------------- validation


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_range(
    fn: str, name: str, value: object, *, upper: float | None = None, accepted: str
) -> float:
    """``value`` as a float when it is a finite real number in [0, upper) (or [0, inf)),
    else raise (inf and NaN are never accepted: they would put inf / NaN into the params)."""
    ok = (_is_real(value) and math.isfinite(value)  # type: ignore[arg-type]
          and value >= 0.0 and (upper is None or value < upper))  # type: ignore[operator]
    if not ok:
        raise ValueError(f"{fn}: invalid {name} {value!r}; accepted: {accepted}")
    return float(value)  # type: ignore[arg-type]


def _check_lr(fn: str, lr: object) -> float | Schedule:
    if callable(lr):
        return lr  # type: ignore[return-value]
    return _check_range(
        fn, "learning rate lr", lr,
        accepted="a finite float >= 0 or a schedule callable(count) -> 0-d tensor or float",
    )


def _check_betas(fn: str, betas: object) -> tuple[float, float]:
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(
            f"{fn}: invalid betas {betas!r}; accepted: a pair (beta1, beta2) of floats in [0, 1)"
        )
    return tuple(  # type: ignore[return-value]
        _check_range(fn, f"beta parameter at index {i}", b, upper=1.0,
                     accepted="a finite float in [0, 1)")
        for i, b in enumerate(betas)
    )


def _state_dtype(fn: str, state_dtype: object) -> torch.dtype | None:
    if state_dtype is None:
        return None
    try:
        return _dtype(state_dtype)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{fn}: invalid state_dtype: {e}") from None


# --------------------------------------------------------------------------- tree helpers


def _flatten_params(fn: str, params: Any) -> tuple[list[torch.Tensor], Any]:
    """Flatten ``params``; every leaf must be a floating tensor (else name its path)."""
    leaves, spec = optree.tree_flatten(params)
    if not all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves):
        accessors, leaves, spec = optree.tree_flatten_with_accessor(params)
        for acc, x in zip(accessors, leaves, strict=True):
            if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
                what = (f"a {x.dtype} tensor" if isinstance(x, torch.Tensor)
                        else f"a {type(x).__name__} ({x!r})")
                raise ValueError(
                    f"{fn}.init: leaf {acc.codify('params')} is {what}; every leaf must be "
                    "a floating-point tensor (float16, bfloat16, float32, float64), or None "
                    "to leave it out"
                )
    return leaves, spec


def _flatten_like(tree: Any, spec: Any, what: str, like: str) -> list[Any]:
    """The leaves of ``tree``, which must have the structure ``spec``."""
    leaves, tspec = optree.tree_flatten(tree)
    # Under torch.compile the check is skipped: dynamo of torch 2.11 cannot trace
    # PyTreeSpec.__eq__. A mismatch in the leaf count still fails in the foreach ops.
    if not torch.compiler.is_compiling() and tspec != spec:
        raise ValueError(
            f"{what} must have the structure of the {like}: {like} is {spec}, {what} is {tspec}"
        )
    return leaves


def _check_shapes(leaves: list[Any], like: list[Any], spec: Any, what: str,
                  like_name: str) -> None:
    """Each leaf must have the shape of its counterpart (else torch would broadcast)."""
    if [getattr(x, "shape", None) for x in leaves] == [getattr(y, "shape", None) for y in like]:
        return
    for path, x, y in zip(spec.paths(), leaves, like, strict=True):
        xs, ys = getattr(x, "shape", None), getattr(y, "shape", None)
        if xs != ys:
            xs, ys = (tuple(v) if v is not None else v for v in (xs, ys))
            raise ValueError(
                f"{what} leaf {'.'.join(map(str, path))!r} has shape {xs}"
                f" but its {like_name} has shape {ys}: the "
                "optimizer state was made for other params (rebuild it with "
                "optimizer.init(params), or TrainState.create)"
            )


def _state_leaves(tree: Any, spec: Any, what: str, g: list[torch.Tensor]) -> list[Any]:
    """The leaves of a moment tree: the structure of the grads, and each grad's shape."""
    leaves = _flatten_like(tree, spec, what, "grads")
    _check_shapes(leaves, g, spec, what, "grad (and param)")
    return leaves


def _expect_state(fn: str, state: Any, cls: type | tuple[type, ...]) -> None:
    """A clear error for a state made by another optimizer (or no state at all)."""
    if isinstance(state, cls):
        return
    names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    raise TypeError(
        f"{fn}.update: the optimizer state is a {type(state).__name__}, but {fn} needs the "
        f"{names} made by its own init; was the state made by another optimizer? Build it "
        "with this optimizer: state = optimizer.init(params) (or TrainState.create(params, "
        "optimizer, ...))"
    )


def _need_params(fn: str, params: Any, spec: Any) -> list[torch.Tensor]:
    if params is None:
        raise ValueError(f"{fn}.update needs params (weight decay uses them); got params=None")
    return _flatten_like(params, spec, "params", "grads")


def _device(leaves: list[torch.Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


def _store_dtype(x: torch.Tensor, state_dtype: torch.dtype | None) -> torch.dtype:
    return x.dtype if state_dtype is None else state_dtype


def _compute_dtype(d: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    d = torch.promote_types(d, torch.float32)
    return d if state_dtype is None else torch.promote_types(d, state_dtype)


def _cast(xs: list[torch.Tensor], dts: list[torch.dtype]) -> list[torch.Tensor]:
    """Leafwise ``x.to(d)``; a leaf already of ``d`` is returned as it is (no copy)."""
    return [x if x.dtype == d else x.to(d) for x, d in zip(xs, dts, strict=True)]


def _zeros(leaves: list[torch.Tensor], state_dtype: torch.dtype | None) -> list[torch.Tensor]:
    return [torch.zeros_like(x, dtype=_store_dtype(x, state_dtype)) for x in leaves]


def _count(leaves: list[torch.Tensor]) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int32, device=_device(leaves))


def _increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the int32 maximum (branch-free)."""
    return torch.where(count < _INT32_MAX, count + 1, count)


def _no_leaves(spec: Any, state: Any) -> tuple[Any, Any]:
    """The update of a tree without leaves (``torch._foreach_*`` needs one): the count moves."""
    held = optree.tree_leaves([getattr(state, f) for f in getattr(state, "_fields", ())
                               if f != "count"])
    if held:
        raise ValueError(
            f"grads must have the structure of the state's moments: grads is {spec} (no "
            f"tensors), the state holds {len(held)} moment tensor(s)"
        )
    if isinstance(getattr(state, "count", None), torch.Tensor):
        state = state._replace(count=_increment(state.count))
    return optree.tree_unflatten(spec, []), state


def _lr_value(lr: Schedule, count: torch.Tensor) -> float | torch.Tensor:
    value = lr(count)
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32)
    return float(value)


def _lr_valid(value: float | torch.Tensor) -> torch.Tensor | bool:
    """Whether a scheduled rate is finite and >= 0 (a bool tensor for a tensor rate)."""
    if isinstance(value, torch.Tensor):
        return value.isfinite() & (value >= 0)
    return math.isfinite(value) and value >= 0.0


def _lr_at(lr: float | Schedule, count: torch.Tensor) -> float | torch.Tensor:
    """The learning rate for the update after ``count`` applied ones.

    A scheduled rate that is not finite or is negative is replaced by 0 (branch-free, no
    host sync), so it can never put inf / NaN into the params; :func:`train_step` also
    skips such a step (see :func:`schedule_ok`).
    """
    if not callable(lr):
        return lr
    value = _lr_value(lr, count)
    ok = _lr_valid(value)
    if isinstance(value, torch.Tensor):
        return torch.where(ok, value, torch.zeros_like(value))
    return value if ok else 0.0


def _schedule_check(lr: float | Schedule) -> Callable[[Any], torch.Tensor] | None:
    """``state -> whether the rate read at state.count is valid``, or None for a constant."""
    if not callable(lr):
        return None

    def check(state: Any) -> torch.Tensor:
        ok = _lr_valid(_lr_value(lr, state.count))
        if isinstance(ok, torch.Tensor):
            return ok.reshape(())
        return torch.full((), ok, dtype=torch.bool, device=state.count.device)

    return check


def schedule_ok(optimizer: GradientTransformation, opt_state: Any) -> torch.Tensor | None:
    """Whether the learning rates the next update reads from its schedules are usable.

    A schedule (a callable ``lr``) may return inf, NaN or a negative rate; the optimizer
    then uses 0 instead, and :func:`fmp.train_step` skips the step (params, optimizer state
    and model state unchanged, ``metrics["skipped"]`` True while ``grads_finite`` is True,
    ``metrics["lr_ok"]`` False). Nothing syncs the host.

    Args:
        optimizer: a :class:`GradientTransformation`.
        opt_state: its state (``optimizer.init(params)`` or a later one).

    Returns:
        A 0-d bool tensor (True when every scheduled rate is finite and >= 0), or None
        when the optimizer has no schedule.

    Example:
        >>> opt = fmp.optim.sgd(lambda count: 0.1 - 0.05 * count)
        >>> s = opt.init({"w": torch.ones(1)})
        >>> bool(fmp.optim.schedule_ok(opt, s)), fmp.optim.schedule_ok(fmp.optim.sgd(0.1), s)
        (True, None)
    """
    check = getattr(optimizer, "schedule_ok", None)
    return None if check is None else check(opt_state)


def _add_scaled_(
    out: list[torch.Tensor], xs: list[torch.Tensor], coef: float | torch.Tensor
) -> None:
    """``out += coef * xs`` in place (``out`` must be fresh tensors owned by the caller)."""
    if isinstance(coef, torch.Tensor):
        torch._foreach_add_(out, torch._foreach_mul(xs, coef))
    else:
        torch._foreach_add_(out, xs, alpha=coef)


def _step_dtype(dts: list[torch.dtype]) -> torch.dtype:
    """float64 for the step scalars (bias corrections) where a leaf computes in float64."""
    return torch.float64 if torch.float64 in dts else torch.float32


def _bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor | None:
    """``1 - beta**step`` as a float32 0-d tensor, or None for ``beta == 0`` (it is 1).

    Written as ``-expm1(step * log(beta))``: accurate in float32 where ``1 - beta**step``
    would lose digits to cancellation (beta2 = 0.999 at step 1).
    """
    if beta == 0.0:
        return None
    return -torch.expm1(step * math.log(beta))


def _adam_moments(
    g: list[torch.Tensor],
    state: AdamState,
    spec: Any,
    dts: list[torch.dtype],
    b1: float,
    b2: float,
    amsgrad: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """New (mu, nu, nu_max) in compute dtypes, torch's formulas (lerp, mul + addcmul)."""
    mu = _cast(_state_leaves(state.mu, spec, "state.mu", g), dts)
    nu = _cast(_state_leaves(state.nu, spec, "state.nu", g), dts)
    mu = torch._foreach_lerp(mu, g, 1.0 - b1)
    nu = torch._foreach_mul(nu, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
    nu_max = None
    if amsgrad:
        if state.nu_max is None:
            raise TypeError("the optimizer has amsgrad=True but its state has no nu_max (made "
                            "by an optimizer with amsgrad=False); rebuild it with "
                            "optimizer.init(params)")
        old = _cast(_state_leaves(state.nu_max, spec, "state.nu_max", g), dts)
        nu_max = torch._foreach_maximum(old, nu)
    return mu, nu, nu_max


def _adam_direction(
    mu: list[torch.Tensor], v: list[torch.Tensor], step: torch.Tensor, b2: float, eps: float
) -> list[torch.Tensor]:
    """``mu / (sqrt(v) / sqrt(1 - b2**step) + eps)``, torch's eps placement (fresh tensors)."""
    denom = torch._foreach_sqrt(v)
    bc2 = _bias_correction(b2, step)
    if bc2 is not None:
        torch._foreach_div_(denom, bc2.sqrt())
    torch._foreach_add_(denom, eps)
    return torch._foreach_div(mu, denom)


def _adam_state(
    count: torch.Tensor,
    spec: Any,
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    nu_max: list[torch.Tensor] | None,
    old: AdamState,
) -> AdamState:
    """Cast the new moments back to the dtypes of the old ones and rebuild the trees."""

    def back(new: list[torch.Tensor], old_tree: Any) -> Any:
        return optree.tree_unflatten(
            spec, _cast(new, [x.dtype for x in optree.tree_leaves(old_tree)]))

    return AdamState(
        count=count,
        mu=back(mu, old.mu),
        nu=back(nu, old.nu),
        nu_max=None if nu_max is None else back(nu_max, old.nu_max),
    )


# --------------------------------------------------------------------------- public API


def apply_updates(params: Any, updates: Any) -> Any:
    """Add ``updates`` to ``params`` leafwise; each result has its param's dtype.

    The sum is computed in the promoted dtype of the param and its update (for a bf16 or
    fp16 param and a float32 update: in float32, then rounded once to the param's dtype),
    with one multi-tensor ``torch._foreach_add``. Pure: the inputs are not modified.

    Args:
        params: a pytree of floating tensors.
        updates: a pytree of the same structure (as returned by an ``update``).

    Returns:
        A new tree of the params' structure; leaf ``i`` has the dtype of ``params`` leaf
        ``i``.

    Raises:
        ValueError: the trees differ in structure (the message shows both), or a leaf
            is not a tensor.

    Example:
        >>> p = {"w": torch.ones(2, dtype=torch.bfloat16)}
        >>> fmp.optim.apply_updates(p, {"w": torch.full((2,), 0.5)})["w"]
        tensor([1.5000, 1.5000], dtype=torch.bfloat16)
    """
    p, spec = optree.tree_flatten(params)
    u = _flatten_like(updates, spec, "updates", "params")
    if not p:
        return optree.tree_unflatten(spec, [])
    for i, (a, b) in enumerate(zip(p, u, strict=True)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise ValueError(
                f"apply_updates: leaf {i} must be a tensor in params and updates, got "
                f"{type(a).__name__} and {type(b).__name__}"
            )
    _check_shapes(u, p, spec, "updates", "param")
    dts = [torch.promote_types(a.dtype, b.dtype) for a, b in zip(p, u, strict=True)]
    out = torch._foreach_add(_cast(p, dts), _cast(u, dts))
    return optree.tree_unflatten(spec, _cast(out, [a.dtype for a in p]))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: the updates of each feed the next.

    Args:
        *transforms: :class:`GradientTransformation` objects, applied left to right.
            Each ``update`` receives the same ``params``.

    Returns:
        A :class:`GradientTransformation` whose state is the tuple of the sub-states.

    Raises:
        TypeError: an argument is not a :class:`GradientTransformation`.
        ValueError: (in ``update``) the state is not a tuple of one sub-state per
            transformation.

    Example:
        >>> opt = fmp.optim.chain(fmp.optim.add_decayed_weights(1e-4),
        ...                       fmp.optim.trace(0.9),
        ...                       fmp.optim.scale_by_learning_rate(0.1))
        >>> len(opt.init({"w": torch.ones(2)}))
        3
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, expected a "
                "GradientTransformation"
            )

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, Any]:
        if not (isinstance(state, tuple) and len(state) == len(transforms)):
            raise ValueError(
                f"chain.update: state must be a tuple of {len(transforms)} sub-states, got "
                f"{type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    checks = [(i, t.schedule_ok) for i, t in enumerate(transforms) if t.schedule_ok is not None]

    def check(state: tuple[Any, ...]) -> torch.Tensor:
        ok = checks[0][1](state[checks[0][0]])
        for i, c in checks[1:]:
            ok = ok & c(state[i])
        return ok

    return GradientTransformation(init, update, None, check if checks else None)


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant ``step_size``.

    Args:
        step_size: a real number (any sign).

    Returns:
        A stateless :class:`GradientTransformation` (state :class:`EmptyState`).
        Updates are in the compute dtype (float32 for bf16 / fp16 / fp32 grads).

    Raises:
        ValueError: ``step_size`` is not a real number.

    Example:
        >>> u, _ = fmp.optim.scale(-2.0).update({"w": torch.ones(1)}, fmp.optim.EmptyState())
        >>> u
        {'w': tensor([-2.])}
    """
    if not _is_real(step_size) or not math.isfinite(step_size):  # type: ignore[arg-type]
        raise ValueError(f"scale: invalid step_size {step_size!r}; accepted: a finite float")
    factor = float(step_size)

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        g = _cast(g, [_compute_dtype(x.dtype, None) for x in g])
        return optree.tree_unflatten(spec, torch._foreach_mul(g, factor)), state

    return GradientTransformation(init, update)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (by ``+learning_rate`` without flip_sign).

    Args:
        learning_rate: a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        flip_sign: negate, so that the result is a descent step (the default).

    Returns:
        A :class:`GradientTransformation`; its state is :class:`EmptyState` for a
        constant rate and :class:`ScaleByScheduleState` for a schedule.

    Raises:
        ValueError: ``learning_rate`` is negative, NaN or neither a float nor callable.

    Example:
        >>> t = fmp.optim.scale_by_learning_rate(0.1)
        >>> t.update({"w": torch.ones(1)}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([-0.1000])}
    """
    lr = _check_lr("scale_by_learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(params: Any) -> EmptyState | ScaleByScheduleState:
        if callable(lr):
            return ScaleByScheduleState(_count(optree.tree_leaves(params)))
        return EmptyState()

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        _expect_state("scale_by_learning_rate", state,
                      ScaleByScheduleState if callable(lr) else EmptyState)
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        g = _cast(g, [_compute_dtype(x.dtype, None) for x in g])
        if callable(lr):
            factor = _lr_at(lr, state.count) * sign
            state = ScaleByScheduleState(_increment(state.count))
        else:
            factor = lr * sign
        return optree.tree_unflatten(spec, torch._foreach_mul(g, factor)), state

    return GradientTransformation(init, update, None, _schedule_check(lr))


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (L2 / decoupled weight decay).

    Before a momentum or Adam scaling this is torch's coupled L2 decay
    (``grad + wd * param``); after :func:`scale_by_adam` and before
    :func:`scale_by_learning_rate` it is AdamW's decoupled decay.

    Args:
        weight_decay: a float >= 0.

    Returns:
        A stateless :class:`GradientTransformation`; its ``update`` needs ``params``.
        Updates are in the promoted dtype of update, param and float32.

    Raises:
        ValueError: ``weight_decay`` is negative or not a number; (in ``update``)
            ``params`` is None or differs in structure from the updates.

    Example:
        >>> t = fmp.optim.add_decayed_weights(0.5)
        >>> p = {"w": torch.ones(1)}
        >>> t.update({"w": torch.zeros(1)}, t.init(p), p)[0]
        {'w': tensor([0.5000])}
    """
    wd = _check_range("add_decayed_weights", "weight_decay", weight_decay,
                      accepted="a finite float >= 0")

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(grads: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        p = _need_params("add_decayed_weights", params, spec)
        dts = [_compute_dtype(torch.promote_types(a.dtype, b.dtype), None)
               for a, b in zip(g, p, strict=True)]
        out = torch._foreach_add(_cast(g, dts), _cast(p, dts), alpha=wd)
        return optree.tree_unflatten(spec, out), state

    return GradientTransformation(init, update)


def trace(
    decay: float,
    *,
    dampening: float = 0.0,
    nesterov: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Momentum as in ``torch.optim.SGD``: ``buf = decay * buf + (1 - dampening) * g``.

    On the first update the buffer is set to the incoming updates, with no dampening
    (torch's ``buf = grad.clone()``). The output is ``buf``, or ``g + decay * buf`` with
    ``nesterov=True``. Follow it with :func:`scale_by_learning_rate` for SGD.

    Args:
        decay: the momentum factor, a float >= 0.
        dampening: dampening of the incoming updates (torch's ``dampening``).
        nesterov: Nesterov momentum; needs ``decay > 0`` and ``dampening == 0``.
        state_dtype: dtype of the buffers (default float32; None keeps each param's).

    Returns:
        A :class:`GradientTransformation` with state :class:`TraceState`.

    Raises:
        ValueError: bad hyper-parameters (the message names the value and what is
            accepted); (in ``update``) a tree differs in structure from the state.

    Example:
        >>> t = fmp.optim.trace(0.9)
        >>> s = t.init({"w": torch.ones(1)})
        >>> u, s = t.update({"w": torch.ones(1)}, s)
        >>> t.update({"w": torch.ones(1)}, s)[0]
        {'w': tensor([1.9000])}
    """
    m, d, sd = _check_momentum("trace", decay, dampening, nesterov, state_dtype)

    def init(params: Any) -> TraceState:
        leaves, spec = _flatten_params("trace", params)
        return TraceState(_count(leaves), optree.tree_unflatten(spec, _zeros(leaves, sd)))

    def update(grads: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        _expect_state("trace", state, TraceState)
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        buf = _state_leaves(state.trace, spec, "state.trace", g)
        dts = [_compute_dtype(x.dtype, sd) for x in g]
        out, new_buf = _momentum(_cast(g, dts), _cast(buf, dts), state.count, m, d, nesterov)
        new_buf = _cast(new_buf, [x.dtype for x in buf])
        return (optree.tree_unflatten(spec, out),
                TraceState(_increment(state.count), optree.tree_unflatten(spec, new_buf)))

    return GradientTransformation(init, update)


def _check_momentum(
    fn: str, momentum: object, dampening: object, nesterov: object, state_dtype: object
) -> tuple[float, float, torch.dtype | None]:
    m = _check_range(fn, "momentum", momentum, accepted="a finite float >= 0")
    if not _is_real(dampening) or not math.isfinite(dampening):  # type: ignore[arg-type]
        raise ValueError(f"{fn}: invalid dampening {dampening!r}; accepted: a finite float")
    d = float(dampening)  # type: ignore[arg-type]
    if not isinstance(nesterov, bool):
        raise ValueError(f"{fn}: invalid nesterov {nesterov!r}; accepted: True or False")
    if nesterov and (m <= 0.0 or d != 0.0):
        raise ValueError(
            f"{fn}: Nesterov momentum requires a momentum > 0 and zero dampening; got "
            f"momentum={m}, dampening={d}"
        )
    return m, d, _state_dtype(fn, state_dtype)


def _momentum(
    g: list[torch.Tensor],
    buf: list[torch.Tensor],
    count: torch.Tensor,
    m: float,
    d: float,
    nesterov: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """torch's momentum step on compute-dtype lists; returns (direction, new buffer).

    The buffer starts at zero, so ``m * 0 + 1 * g`` reproduces torch's first-step
    ``buf = grad`` exactly; with dampening the coefficient of ``g`` is 1 on the first
    update and ``1 - d`` after, picked with ``torch.where`` on the count.
    """
    new = torch._foreach_mul(buf, m)
    if d == 0.0:
        torch._foreach_add_(new, g)
    else:
        one = torch.ones((), dtype=torch.float32, device=count.device)
        _add_scaled_(new, g, torch.where(count == 0, one, one * (1.0 - d)))
    if nesterov:
        return torch._foreach_add(g, new, alpha=m), new
    return new, new


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Stochastic gradient descent with the formulas of ``torch.optim.SGD``.

    Per step, with ``g`` the grad (in the compute dtype)::

        g = g + weight_decay * p                      # if weight_decay
        buf = g (first step), else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf   # if momentum
        update = -lr * g

    ``maximize`` is not offered (negate the grads, or use ``scale(-1)``).

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        momentum: momentum factor, a float >= 0 (0 disables the buffers).
        dampening: dampening for momentum (any float, as in torch).
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
        weight_decay: coupled L2 penalty, a float >= 0; ``update`` then needs params.
        state_dtype: dtype of the momentum buffers (default float32, also for bf16 /
            fp16 params; None keeps each param's dtype, like torch).

    Returns:
        A :class:`GradientTransformation` with state :class:`SgdState`.

    Raises:
        ValueError: a bad hyper-parameter (the message names the value and what is
            accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.sgd(0.1, momentum=0.9)
        >>> p = {"w": torch.ones(2)}
        >>> u, s = opt.update({"w": torch.ones(2)}, opt.init(p), p)
        >>> fmp.optim.apply_updates(p, u)
        {'w': tensor([0.9000, 0.9000])}
    """
    lr = _check_lr("sgd", lr)
    m, d, sd = _check_momentum("sgd", momentum, dampening, nesterov, state_dtype)
    wd = _check_range("sgd", "weight_decay", weight_decay, accepted="a finite float >= 0")

    def init(params: Any) -> SgdState:
        leaves, spec = _flatten_params("sgd", params)
        buf = optree.tree_unflatten(spec, _zeros(leaves, sd)) if m != 0.0 else None
        return SgdState(_count(leaves), buf)

    def update(grads: Any, state: SgdState, params: Any = None) -> tuple[Any, SgdState]:
        _expect_state("sgd", state, SgdState)
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        dts = [_compute_dtype(x.dtype, sd) for x in g]
        g = _cast(g, dts)
        if wd != 0.0:
            g = torch._foreach_add(g, _cast(_need_params("sgd", params, spec), dts), alpha=wd)
        new_buf = None
        if m != 0.0:
            if state.momentum is None:
                raise TypeError("sgd.update: this sgd has momentum but the state holds no "
                                "momentum buffers (made by an sgd with momentum=0); rebuild "
                                "it with optimizer.init(params)")
            buf = _state_leaves(state.momentum, spec, "state.momentum", g)
            g, nb = _momentum(g, _cast(buf, dts), state.count, m, d, nesterov)
            new_buf = optree.tree_unflatten(spec, _cast(nb, [x.dtype for x in buf]))
        updates = torch._foreach_mul(g, -_lr_at(lr, state.count))
        return (optree.tree_unflatten(spec, updates),
                SgdState(_increment(state.count), new_buf))

    fused = FusedSpec("sgd", momentum=m, dampening=d, nesterov=nesterov, wd=wd,
                      lr_at=lambda c: _lr_at(lr, c))
    return GradientTransformation(init, update, fused, _schedule_check(lr))


def _adam_init(fn: str, sd: torch.dtype | None, amsgrad: bool) -> Callable[[Any], AdamState]:
    """The ``init`` of Adam-family transformations: zero moments in the state dtype."""

    def init(params: Any) -> AdamState:
        leaves, spec = _flatten_params(fn, params)
        return AdamState(
            count=_count(leaves),
            mu=optree.tree_unflatten(spec, _zeros(leaves, sd)),
            nu=optree.tree_unflatten(spec, _zeros(leaves, sd)),
            nu_max=optree.tree_unflatten(spec, _zeros(leaves, sd)) if amsgrad else None,
        )

    return init


def _adam_like(
    fn: str,
    lr: float | Schedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    state_dtype: str | torch.dtype | None,
    decoupled: bool,
) -> GradientTransformation:
    lr = _check_lr(fn, lr)
    b1, b2 = _check_betas(fn, betas)
    eps = _check_range(fn, "epsilon value eps", eps, accepted="a finite float >= 0")
    wd = _check_range(fn, "weight_decay", weight_decay, accepted="a finite float >= 0")
    if not isinstance(amsgrad, bool):
        raise ValueError(f"{fn}: invalid amsgrad {amsgrad!r}; accepted: True or False")
    sd = _state_dtype(fn, state_dtype)

    init = _adam_init(fn, sd, amsgrad)

    def update(grads: Any, state: AdamState, params: Any = None) -> tuple[Any, AdamState]:
        _expect_state(fn, state, AdamState)
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        dts = [_compute_dtype(x.dtype, sd) for x in g]
        g = _cast(g, dts)
        p = _cast(_need_params(fn, params, spec), dts) if wd != 0.0 else None
        if p is not None and not decoupled:
            g = torch._foreach_add(g, p, alpha=wd)
        lr_now = _lr_at(lr, state.count)
        count = _increment(state.count)
        step = count.to(_step_dtype(dts))
        mu, nu, nu_max = _adam_moments(g, state, spec, dts, b1, b2, amsgrad)
        updates = _adam_direction(mu, nu if nu_max is None else nu_max, step, b2, eps)
        bc1 = _bias_correction(b1, step)
        step_size = lr_now if bc1 is None else lr_now / bc1
        torch._foreach_mul_(updates, -step_size)
        if p is not None and decoupled:
            _add_scaled_(updates, p, -(lr_now * wd))
        return (optree.tree_unflatten(spec, updates),
                _adam_state(count, spec, mu, nu, nu_max, state))

    fused = FusedSpec("adamw" if decoupled else "adam", b1=b1, b2=b2, eps=eps, wd=wd,
                      amsgrad=amsgrad, lr_at=lambda c: _lr_at(lr, c))
    return GradientTransformation(init, update, fused, _schedule_check(lr))


def adam(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Adam with the formulas of ``torch.optim.Adam`` (coupled L2 weight decay).

    Per step ``t = count + 1``, with ``g`` the grad in the compute dtype::

        g = g + weight_decay * p                      # if weight_decay
        mu = lerp(mu, g, 1 - beta1);  nu = beta2 * nu + (1 - beta2) * g * g
        v = max(nu_max, nu) if amsgrad else nu
        denom = sqrt(v) / sqrt(1 - beta2**t) + eps
        update = -(lr / (1 - beta1**t)) * mu / denom

    ``maximize``, ``capturable``, ``fused`` and complex params are not offered (the
    update is always capturable: no host sync).

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, a float >= 0.
        weight_decay: coupled L2 penalty added to the grad, a float >= 0; ``update``
            then needs params.
        amsgrad: keep the running maximum of ``nu`` and divide by it (AMSGrad).
        state_dtype: dtype of the moments (default float32, also for bf16 / fp16 params;
            None keeps each param's dtype, like torch).

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter (the message names the value and what is
            accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.adam(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> u, s = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(p), p)
        >>> u
        {'w': tensor([-0.1000,  0.1000])}
    """
    return _adam_like("adam", lr, betas, eps, weight_decay, amsgrad, state_dtype, False)


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """AdamW with the formulas of ``torch.optim.AdamW`` (decoupled weight decay).

    As :func:`adam` without the L2 term on the grad; instead the update also holds
    ``-lr * weight_decay * p`` (torch's ``p *= 1 - lr * weight_decay``), with ``lr`` the
    current (scheduled) rate.

    Args:
        lr: learning rate, a float >= 0, or a :data:`Schedule` evaluated on the number of
            updates applied before this one.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, a float >= 0.
        weight_decay: decoupled decay, a float >= 0 (default 1e-2 as in torch);
            ``update`` then needs params.
        amsgrad: keep the running maximum of ``nu`` and divide by it (AMSGrad).
        state_dtype: dtype of the moments (default float32, also for bf16 / fp16 params;
            None keeps each param's dtype, like torch).

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter (the message names the value and what is
            accepted); (in ``init``) a leaf is not a floating tensor; (in ``update``)
            a tree differs in structure, or params are missing with weight decay.

    Example:
        >>> opt = fmp.optim.adamw(0.1, weight_decay=0.5)
        >>> p = {"w": torch.ones(1)}
        >>> opt.update({"w": torch.ones(1)}, opt.init(p), p)[0]
        {'w': tensor([-0.1500])}
    """
    return _adam_like("adamw", lr, betas, eps, weight_decay, amsgrad, state_dtype, True)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    amsgrad: bool = False,
    state_dtype: str | torch.dtype | None = torch.float32,
) -> GradientTransformation:
    """Adam's rescaling without the learning rate: ``mu_hat / (sqrt(nu_hat) + eps)``.

    With torch's eps placement: ``(mu / (1 - b1**t)) / (sqrt(nu) / sqrt(1 - b2**t) + eps)``.
    ``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))`` is
    AdamW up to rounding; :func:`adam` / :func:`adamw` are the fused forms.

    Args:
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1).
        eps: added to the denominator, a float >= 0.
        amsgrad: divide by the running maximum of ``nu``.
        state_dtype: dtype of the moments (default float32; None keeps each param's).

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Raises:
        ValueError: a bad hyper-parameter; (in ``init``) a leaf is not a floating
            tensor; (in ``update``) a tree differs in structure from the state.

    Example:
        >>> t = fmp.optim.scale_by_adam()
        >>> t.update({"w": torch.tensor([2.0])}, t.init({"w": torch.ones(1)}))[0]
        {'w': tensor([1.0000])}
    """
    fn = "scale_by_adam"
    b1, b2 = _check_betas(fn, (b1, b2))
    eps = _check_range(fn, "epsilon value eps", eps, accepted="a finite float >= 0")
    if not isinstance(amsgrad, bool):
        raise ValueError(f"{fn}: invalid amsgrad {amsgrad!r}; accepted: True or False")
    sd = _state_dtype(fn, state_dtype)

    init = _adam_init(fn, sd, amsgrad)

    def update(grads: Any, state: AdamState, params: Any = None) -> tuple[Any, AdamState]:
        _expect_state(fn, state, AdamState)
        g, spec = optree.tree_flatten(grads)
        if not g:
            return _no_leaves(spec, state)
        dts = [_compute_dtype(x.dtype, sd) for x in g]
        g = _cast(g, dts)
        count = _increment(state.count)
        step = count.to(_step_dtype(dts))
        mu, nu, nu_max = _adam_moments(g, state, spec, dts, b1, b2, amsgrad)
        updates = _adam_direction(mu, nu if nu_max is None else nu_max, step, b2, eps)
        bc1 = _bias_correction(b1, step)
        if bc1 is not None:
            torch._foreach_div_(updates, bc1)
        return (optree.tree_unflatten(spec, updates),
                _adam_state(count, spec, mu, nu, nu_max, state))

    return GradientTransformation(init, update)
