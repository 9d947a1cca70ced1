"""The pure train step: value_and_grad under a policy and loss scale, then a skip-safe update."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import optree
import torch

from fmp import _model
from fmp._batch_cast import CastBatch, cast_batch_args, check_cast_batch, warn_cast_overflow
from fmp._checks import check_loss_scale, check_param_policies
from fmp._compute_copy import CopyStamps
from fmp._donation import all_owned, claim, host_prepared, private
from fmp._eager import eager_kernels_ok
from fmp._grad import grad_with_aux
from fmp._step_type import GradReducer, TrainStep
from fmp.loss_scale import NoOpLossScale
from fmp.optim import (
    GradientTransformation,
    apply_updates,
    in_place_supported,
    schedule_ok,
    update_in_place,
)
from fmp.policy import Policy, cast_params, get_policy
from fmp.tree import floating_leaves, select_tree

__all__ = ["GradReducer", "TrainState", "TrainStep", "value_and_grad"]


class TrainState(NamedTuple):
    """Everything a train step reads and returns: an immutable record (a pytree).

    Attributes:
        params: the params tree, in the policy's param dtype.
        opt_state: the optimizer's state (``optimizer.init(params)``).
        loss_scale: a loss-scale record (:class:`fmp.NoOpLossScale`, :class:`fmp.StaticLossScale`
            or :class:`fmp.DynamicLossScale`).
        step: 0-d int64 tensor, the number of step calls so far (skipped ones included).
        model_state: buffers such as BatchNorm running statistics, or None.
        skipped_total: 0-d int32 tensor, how many steps were skipped (never reset).
        compute_params: the params cast to the compute dtype, written by the last step's
            update (``train_step(..., compute_copy=True)``, mixed policies), or None. A
            cache: the next step reads it instead of casting the params, and rebuilds it
            whenever it cannot tell that it is current (see :func:`train_step`).

    Example:
        >>> state = fmp.TrainState.create({"w": torch.zeros(3)}, fmp.optim.sgd(0.1))
        >>> int(state.step), int(state.skipped_total)
        (0, 0)
    """

    params: Any
    opt_state: Any
    loss_scale: Any
    step: torch.Tensor
    model_state: Any = None
    skipped_total: torch.Tensor | None = None
    compute_params: Any = None

    @classmethod
    def create(cls, params: Any, optimizer: GradientTransformation, loss_scale: Any = None,
               model_state: Any = None) -> TrainState:
        """Initialise a state: optimizer state, counters, and the loss scale on the params' device.

        Args:
            params: the params tree (e.g. from :func:`fmp.functional`).
            optimizer: a :class:`fmp.optim.GradientTransformation`.
            loss_scale: a loss-scale record; None means :class:`fmp.NoOpLossScale`.
            model_state: buffers to carry (for ``train_step(..., has_state=True)``).

        Returns:
            A :class:`TrainState` with ``step`` 0 (int64) and ``skipped_total`` 0 (int32).

        Raises:
            TypeError: ``optimizer`` is not a GradientTransformation, or ``loss_scale`` is
                not a loss-scale record.
        """
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(f"optimizer must be an fmp.optim.GradientTransformation, got "
                            f"{type(optimizer).__name__}")
        if loss_scale is None:
            loss_scale = NoOpLossScale()
        if not (hasattr(loss_scale, "scale") and hasattr(loss_scale, "adjust")):
            raise TypeError(f"loss_scale must be an fmp loss-scale record (NoOpLossScale, "
                            f"StaticLossScale, DynamicLossScale) or None, got "
                            f"{type(loss_scale).__name__}")
        leaves = floating_leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        opt_state = optimizer.init(params)
        given = {id(x) for x in optree.tree_leaves(params)}
        claim([x for x in optree.tree_leaves(opt_state) if id(x) not in given])
        return cls(
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale.to(device),
            step=torch.zeros((), dtype=torch.int64, device=device),
            model_state=model_state,
            skipped_total=torch.zeros((), dtype=torch.int32, device=device),
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as a nested dict of tensors and plain values (:mod:`fmp.checkpoint`).

        Returns:
            A dict for ``torch.save`` or ``torch.distributed.checkpoint``; its tensors are
            this state's own. ``compute_params`` is left out (the next step rebuilds it).

        Example:
            >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1))
            >>> sorted(s.state_dict()["params"])
            ['w']
        """
        from fmp.checkpoint import state_dict

        return state_dict(self)

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> TrainState:
        """Rebuild a state from :meth:`state_dict`'s output, exactly (:mod:`fmp.checkpoint`).

        Args:
            d: the state dict (e.g. ``torch.load(path)``, or one DCP loaded into).

        Returns:
            The :class:`TrainState` holding ``d``'s tensors.

        Raises:
            ValueError: ``d`` is not a TrainState state dict.

        Example:
            >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.adam())
            >>> int(fmp.TrainState.from_state_dict(s.state_dict()).step)
            0
        """
        from fmp.checkpoint import from_state_dict

        return from_state_dict(d)


def _autocast_ctx(params: Any, compute_dtype: torch.dtype, enabled: bool):
    if not enabled or compute_dtype not in (torch.float16, torch.bfloat16):
        return contextlib.nullcontext()
    leaves = floating_leaves(params)
    device_type = leaves[0].device.type if leaves else "cpu"
    return torch.autocast(device_type=device_type, dtype=compute_dtype)


def _check_loss(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.dim() == 0):
        what = (f"a tensor of dtype {loss.dtype} and shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor) else type(loss).__name__)
        raise ValueError(f"loss_fn must return a 0-d floating tensor as its loss, got {what}")
    return loss


def value_and_grad(
    loss_fn: Callable[..., Any],
    policy: str | Policy = "fp32",
    has_aux: bool = False,
    autocast: bool = False,
    param_policies: Mapping[str, Policy] | None = None,
    cast_batch: CastBatch = True,
) -> Callable[..., tuple[Any, Any, torch.Tensor]]:
    """Loss, unscaled grads and a finite flag, computed under a mixed-precision policy.

    The returned ``fn(params, loss_scale, *args, **kwargs)``:

    1. casts ``params`` to the compute dtype (per parameter with ``param_policies``; norm
       layers of an :func:`fmp.functional` module stay float32 under mixed presets) and
       the floating leaves of ``args``/``kwargs`` to the policy's compute dtype;
    2. calls ``loss_fn(cast_params, *cast_args, **cast_kwargs)``, inside ``torch.autocast``
       when ``autocast=True`` (op-level cast lists, as Apex O1);
    3. scales the loss (in float32) and differentiates it (``torch.func.grad`` when compiled
       or inside a torch.func transform, ``torch.autograd.grad`` on detached aliases in
       eager mode: the same function, the fastest kernels); the casts are differentiable,
       so grads arrive in each param's own dtype;
    4. unscales the grads and checks them with :func:`fmp.all_finite`.

    Args:
        loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (a 0-d floating tensor), or
            ``-> (loss, aux)`` with ``has_aux=True``.
        policy: a :class:`fmp.Policy` or a spec for :func:`fmp.get_policy`.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        autocast: also run ``loss_fn`` under ``torch.autocast`` at the compute dtype.
        param_policies: per-parameter policies (from :func:`fmp.module_policies`) for the
            compute cast of a params dict; inputs still follow ``policy``.
        cast_batch: which arguments' floating leaves are cast to the compute dtype: True
            (all), False (none), or one bool per positional argument (keyword arguments
            are cast unless it is False). The first call warns when the cast turns a
            finite value into inf (e.g. a float16 target above 65504).

    Returns:
        ``fn(params, loss_scale, *args, **kwargs) -> (loss, grads, finite)``, or
        ``((loss, aux), grads, finite)`` with ``has_aux``; ``loss`` is the unscaled float32
        loss, ``grads`` are unscaled, ``finite`` is a 0-d bool tensor. Nothing syncs the host.

    Raises:
        ValueError: (when called) ``loss_fn`` returned something other than a 0-d floating
            tensor as its loss; the policy spec is bad (at once).
        TypeError: ``param_policies`` is not a dict of :class:`fmp.Policy` (at once);
            (when called) ``loss_scale`` is not a loss-scale record (None, a float).

    Example:
        >>> vg = fmp.value_and_grad(lambda p, x: (p["w"] * x).sum(), "bf16-mixed")
        >>> loss, grads, finite = vg({"w": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3))
        >>> grads["w"].dtype, bool(finite)
        (torch.float32, True)
    """
    check_param_policies(param_policies, "value_and_grad")
    pol = get_policy(policy)
    cast_batch = check_cast_batch(cast_batch)
    cast_p = _Caster(pol, param_policies)
    scaled_loss = _scaled_loss_fn(loss_fn, pol, has_aux, autocast, cast_p, cast_batch)
    first = [True]

    def fn(params: Any, loss_scale: Any, *args: Any, **kwargs: Any):
        check_loss_scale(loss_scale, "value_and_grad")
        if first[0] and not torch.compiler.is_compiling():
            first[0] = False
            warn_cast_overflow(args, kwargs, pol.compute_dtype, cast_batch,
                               "fmp.value_and_grad")
        cast_p.resolve(params)  # norm layers of an fmp.functional module: float32
        grads, (loss, aux) = grad_with_aux(
            lambda p: scaled_loss(p, loss_scale, (), args, kwargs, True), params)
        grads, finite = loss_scale.unscale_and_check(grads)
        return ((loss, aux) if has_aux else loss), grads, finite

    return fn


class _Caster:
    """The cast of a params tree to its compute dtypes (per param with ``param_policies``).

    Without ``param_policies`` and under a mixed policy with float32 params, the params of
    norm layers stay in float32 when the params dict matches a module given to
    :func:`fmp.functional` (:func:`fmp._model.default_param_policies`, looked up in eager
    mode whenever the dict's names change). One object per step, the cast its compute
    copy's stamps vouch for.
    """

    def __init__(self, pol: Policy, param_policies: Mapping[str, Policy] | None) -> None:
        self.pol = pol
        self.given = param_policies
        self.policies = param_policies
        self._names: tuple[Any, ...] | None = None

    def resolve(self, params: Any) -> None:
        """Find the default per-param policies for ``params`` (eager, host side)."""
        if self.given is not None or torch.compiler.is_compiling():
            return
        names = tuple(params) if isinstance(params, Mapping) else None
        if names != self._names:
            self.policies = _model.default_param_policies(params, self.pol)
            self._names = names

    def __call__(self, p: Any) -> Any:
        if self.policies is not None:
            return cast_params(p, self.policies, "compute")
        return self.pol.cast_to_compute(p)


def _scaled_loss_fn(loss_fn: Callable[..., Any], pol: Policy, has_aux: bool, autocast: bool,
                    cast_p: _Caster, cast_batch: CastBatch = True,
                    skip_safe: bool = False) -> Callable[..., Any]:
    """``f(params, loss_scale, lead, args, kwargs, cast) -> (scaled_loss, (loss32, aux))``.

    ``lead`` is passed to ``loss_fn`` before the batch and is not cast (model state);
    ``cast=False``: ``params`` are already in their compute dtypes (the step's copy).
    """
    def scaled_loss(p: Any, loss_scale: Any, lead: tuple[Any, ...], args: tuple[Any, ...],
                    kwargs: dict[str, Any], cast: bool):
        cp = cast_p(p) if cast else p
        cargs, ckwargs = cast_batch_args(args, kwargs, pol.compute_dtype, cast_batch)
        act = _model.ACTIVE  # what apply_fn reads: how to cast the frozen params
        prev = (act.policy, act.param_policies, act.skip_safe)
        act.policy, act.param_policies, act.skip_safe = pol, cast_p.policies, skip_safe
        try:
            with _autocast_ctx(p, pol.compute_dtype, autocast):
                out = loss_fn(cp, *lead, *cargs, **ckwargs)
        finally:
            act.policy, act.param_policies, act.skip_safe = prev
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("with has_aux=True, loss_fn must return (loss, aux), got "
                                 f"{type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, None
        loss32 = _check_loss(loss).float()
        return loss_scale.scale(loss32), (loss32, aux)

    return scaled_loss


def _check_param_dtypes(params: Any, pol: Policy,
                        param_policies: Mapping[str, Policy] | None) -> None:
    """A param stored in another dtype than its policy says is a bug: say so, name it."""
    if param_policies is None:  # the common case, every step: names only for the error
        want = pol.param_dtype
        if type(params) is dict and all(  # a dict of tensors (fmp.functional's): one pass
                type(v) is torch.Tensor and (v.dtype == want or not v.is_floating_point())
                for v in params.values()):
            return
        if all(v.dtype == want for v in optree.tree_leaves(params)
               if isinstance(v, torch.Tensor) and v.is_floating_point()):
            return
    if param_policies is not None and isinstance(params, Mapping):
        items = [(k, v, param_policies[k].param_dtype) for k, v in params.items()
                 if k in param_policies]
    else:
        paths, leaves, _ = optree.tree_flatten_with_path(params)
        items = [(".".join(map(str, p)), v, pol.param_dtype) for p, v in zip(paths, leaves,
                                                                              strict=True)]
    for name, v, want in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != want:
            raise ValueError(
                f"param {name!r} is {v.dtype} but the policy keeps params in {want}; cast "
                "them before TrainState.create, e.g. params = policy.cast_to_param(params)"
            )


def _split_batch(batch: tuple[Any, ...], k: int) -> list[tuple[Any, ...]]:
    if k == 1:
        return [batch]
    leaves, spec = optree.tree_flatten(batch)
    chunks = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % k:
                raise ValueError(f"accumulate={k}: batch leaf {i} has leading size "
                                 f"{x.shape[0]}, which is not divisible by {k}")
            chunks.append(torch.chunk(x, k, dim=0))
        else:
            chunks.append((x,) * k)
    return [optree.tree_unflatten(spec, [c[j] for c in chunks]) for j in range(k)]


def _stack_aux(auxes: list[Any]) -> Any:
    """The k micro-batches' aux values as one: tensor leaves stacked along a new dim 0 (in
    micro-batch order), other leaves as a tuple of the k values."""
    leaves0, spec = optree.tree_flatten(auxes[0])
    rows = [spec.flatten_up_to(a) for a in auxes[1:]]
    out = []
    for i, x in enumerate(leaves0):
        column = [x] + [r[i] for r in rows]
        if isinstance(x, torch.Tensor):
            out.append(torch.stack(column))
        else:
            out.append(tuple(column))
    return optree.tree_unflatten(spec, out)


def _to_f32(g: Any) -> Any:
    return g.float() if isinstance(g, torch.Tensor) and g.is_floating_point() else g


def _to_param_dtypes(grads: Any, params: Any) -> Any:
    """Grads of the compute copy converted to their params' dtypes (the cast's backward)."""
    def conv(g: Any, p: Any) -> Any:
        if isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor) and g.dtype != p.dtype:
            return g.to(p.dtype)
        return g

    return optree.tree_map(conv, grads, params)


def _donate_into(old: Any, new: Any) -> Any:
    """Write ``new``'s tensor leaves into ``old``'s tensors in place; return ``old``'s tree.

    ``_foreach_copy_`` converts dtypes: donating params into their compute copy casts them.
    """
    old_leaves, spec = optree.tree_flatten(old)
    dst, src = [], []
    for o, n in zip(old_leaves, spec.flatten_up_to(new), strict=True):
        if isinstance(o, torch.Tensor) and o is not n:
            dst.append(o)
            src.append(n)
    if dst:
        torch._foreach_copy_(dst, src)
    return old


def _private_state(state: TrainState) -> TrainState:
    """``state`` whose params, optimizer and model state a donated step may write into: a
    copy of every tensor no fmp step handed out (the module's, another state's)."""
    if all_owned((state.params, state.opt_state, state.model_state)):
        return state  # every step after the first: one walk
    params, opt_state = private(state.params), private(state.opt_state)
    model_state = private(state.model_state)
    if (params is state.params and opt_state is state.opt_state
            and model_state is state.model_state):
        return state
    return state._replace(params=params, opt_state=opt_state, model_state=model_state,
                          compute_params=(state.compute_params if params is state.params
                                          else None))


def check_step_args(optimizer: Any, accumulate: Any,
                    param_policies: Mapping[str, Policy] | None) -> None:
    """The checks :func:`fmp.train_step` makes of its arguments before anything else."""
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be an fmp.optim.GradientTransformation, got "
                        f"{type(optimizer).__name__}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
    check_param_policies(param_policies, "train_step")


def build_train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    policy: str | Policy = "fp32",
    accumulate: int = 1,
    donate: bool = False,
    reducer: GradReducer | None = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    autocast: bool = False,
    param_policies: Mapping[str, Policy] | None = None,
    compute_copy: bool = True,
    cast_batch: CastBatch = True,
) -> TrainStep:
    """The step :func:`fmp.train_step` returns, its data parallelism given as ``reducer``.

    Args, Returns and Raises: as :func:`fmp.train_step`, whose ``process_group`` is a
    ``reducer`` here (an object with ``reduce(grads)`` and ``all_finite(grads)``, see
    :class:`GradReducer`; None: a single process).

    Example:
        >>> step = fmp.step.build_train_step(lambda p, x: (p["w"] * x).sum(),
        ...                                  fmp.optim.sgd(0.1))
        >>> isinstance(step, fmp.TrainStep)
        True
    """
    check_step_args(optimizer, accumulate, param_policies)
    if reducer is not None and not isinstance(reducer, GradReducer):
        raise TypeError(f"reducer must have reduce(grads) and all_finite(grads) methods "
                        f"(an fmp.GradReducer, e.g. fmp.distributed.GroupReducer), got "
                        f"{type(reducer).__name__}")
    # the data-parallel hooks: None in a single process
    reduce_grads = None if reducer is None else reducer.reduce
    grads_finite = None if reducer is None else reducer.all_finite
    pol = get_policy(policy)
    cast_batch = check_cast_batch(cast_batch)
    first_call = [True]

    def split_out(out: Any) -> tuple[Any, Any, Any]:
        """-> (loss, new_model_state, aux) from loss_fn's return value."""
        if has_state:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("with has_state=True, loss_fn must return (loss, "
                                 f"new_model_state), got {type(out).__name__}")
            loss, rest = out
            if has_aux:
                if not (isinstance(rest, tuple) and len(rest) == 2):
                    raise ValueError("with has_state and has_aux, loss_fn must return "
                                     "(loss, (new_model_state, aux))")
                return loss, rest[0], rest[1]
            return loss, rest, None
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("with has_aux=True, loss_fn must return (loss, aux), got "
                                 f"{type(out).__name__}")
            return out[0], None, out[1]
        return out, None, None

    def wrapped(p: Any, *rest: Any) -> Any:
        """loss_fn as ``(p, [model_state,] *batch) -> (loss, (new_model_state, aux))``."""
        loss, new_ms, a = split_out(loss_fn(p, *rest))
        return loss, (new_ms, a)

    cast_p = _Caster(pol, param_policies)
    stamps = CopyStamps(cast_p)  # this step's record of the copies it wrote
    scaled_loss = _scaled_loss_fn(wrapped, pol, True, autocast, cast_p, cast_batch,
                                  skip_safe=True)
    # params are checked to be in their param dtypes, so whether the cast changes any of
    # them is known now: where it changes none there is no copy to keep or check
    pols = [pol] if param_policies is None else list(param_policies.values())
    keep_copy = compute_copy and any(q.compute_dtype != q.param_dtype for q in pols)

    def grad_phase(state: TrainState, batch: tuple[Any, ...], loss_impl: Callable[..., Any]
                   ) -> tuple[Any, Any, Any, Any]:
        """-> (summed scaled grads, mean loss, aux, new model state), nothing applied yet."""
        micro = _split_batch(batch, accumulate)
        model_state = state.model_state
        copy = state.compute_params
        grad_sum: Any = None
        loss_sum: Any = None
        aux = None
        auxes = []
        for mb in micro:
            lead = (model_state,) if has_state else ()
            grads, (loss, (new_ms, aux)) = grad_with_aux(
                lambda p, _l=lead, _b=mb: loss_impl(p, state.loss_scale, _l, _b, {},
                                                    copy is None),
                state.params if copy is None else copy)
            if has_state:
                model_state = new_ms
            auxes.append(aux)
            if accumulate == 1:
                grad_sum, loss_sum = grads, loss
            else:
                if copy is not None:  # as the cast's backward would have: to param dtypes
                    grads = _to_param_dtypes(grads, state.params)
                g32 = optree.tree_map(_to_f32, grads)
                grad_sum = g32 if grad_sum is None else optree.tree_map(torch.add, grad_sum, g32)
                loss_sum = loss if loss_sum is None else loss_sum + loss
        loss = loss_sum if accumulate == 1 else loss_sum * (1.0 / accumulate)
        if has_aux and accumulate > 1:
            aux = _stack_aux(auxes)
        return grad_sum, loss, aux, model_state

    def update_phase(state: TrainState, batch: tuple[Any, ...], grad_sum: Any, loss: Any,
                     aux: Any, model_state: Any) -> tuple[TrainState, dict[str, Any]]:
        """Unscale, check, update (or skip), adjust the scale: the rest of the step."""
        if state.compute_params is not None and accumulate == 1:
            grad_sum = _to_param_dtypes(grad_sum, state.params)
        lr_ok = schedule_ok(optimizer, state.opt_state)  # a scheduled lr of inf/NaN/< 0 skips
        if donate and in_place_supported(optimizer, state.params, grad_sum, state.opt_state):
            # One in-place pass unscales and checks the step's own grads (where the amp kernel
            # cannot, a read-only check and the fused kernel divides by the scale); torch's
            # fused kernel then updates params and moments in place, or skips on device.
            grads = grad_sum if reduce_grads is None else reduce_grads(grad_sum)
            grads, divisor, finite = state.loss_scale.unscale_for_fused(
                grads, micro_batches=accumulate, protect=(state, batch), check=grads_finite)
            grads_ok, finite = finite, finite if lr_ok is None else finite & lr_ok
            opt_state = update_in_place(optimizer, state.params, grads, state.opt_state,
                                        divisor, (~finite).to(torch.float32))
            params = state.params
        else:
            if reduce_grads is None:  # eager: the same one-pass unscale where it applies
                grads, finite = state.loss_scale.unscale_and_check(
                    grad_sum, in_place=eager_kernels_ok(), micro_batches=accumulate,
                    protect=(state, batch))
            else:
                grads = reduce_grads(state.loss_scale.unscale(grad_sum, micro_batches=accumulate))
                finite = grads_finite(grads)
            grads_ok, finite = finite, finite if lr_ok is None else finite & lr_ok
            updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
            new_params = apply_updates(state.params, updates)
            params = select_tree(finite, new_params, state.params)
            opt_state = select_tree(finite, new_opt_state, state.opt_state)
            if donate:
                params = _donate_into(state.params, params)
                opt_state = _donate_into(state.opt_state, opt_state)
        if has_state:
            model_state = select_tree(finite, model_state, state.model_state)
            if donate:
                model_state = _donate_into(state.model_state, model_state)
        copy = state.compute_params
        if copy is not None:  # the next step's forward reads this instead of casting
            copy = _donate_into(copy, params) if donate else cast_p(params)
        loss_scale = state.loss_scale.adjust(grads_ok)
        skipped = ~finite
        prev_skipped = state.skipped_total
        if prev_skipped is None:
            prev_skipped = torch.zeros((), dtype=torch.int32, device=finite.device)
        skipped_total = prev_skipped + skipped.to(torch.int32)
        new_state = TrainState(params=params, opt_state=opt_state, loss_scale=loss_scale,
                               step=state.step + 1, model_state=model_state,
                               skipped_total=skipped_total, compute_params=copy)
        metrics = {"loss": loss, "grads_finite": grads_ok, "skipped": skipped,
                   "loss_scale": loss_scale.loss_scale, "skipped_total": skipped_total}
        if lr_ok is not None:
            metrics["lr_ok"] = lr_ok
        if has_aux:
            metrics["aux"] = aux
        return new_state, metrics

    def run(state: TrainState, batch: tuple[Any, ...], loss_impl: Callable[..., Any],
            update_impl: Callable[..., Any]) -> tuple[TrainState, dict[str, Any]]:
        """The step, with the scaled loss and the update phase given (fmp.compile passes
        compiled ones)."""
        _check_param_dtypes(state.params, pol, param_policies)
        cast_p.resolve(state.params)
        if donate and not torch.compiler.is_compiling():
            state = _private_state(state)
        elif donate and not host_prepared():
            raise RuntimeError(
                "a donated fmp.train_step traced whole by torch.compile would write into "
                "tensors the module or another state still holds (the copy that prevents "
                "it is host-side work): compile it with fmp.compile(step) (or "
                "fmp.compile(step, whole_graph=True)), or build it with donate=False")
        if first_call[0] and not torch.compiler.is_compiling():
            first_call[0] = False
            warn_cast_overflow(batch, {}, pol.compute_dtype, cast_batch, "fmp.train_step")
        state = prepare(state)
        new_state, metrics = update_impl(state, batch, *grad_phase(state, batch, loss_impl))
        if state.compute_params is not None:
            if (new_state.params is state.params
                    and new_state.compute_params is state.compute_params):
                stamps.restamp()  # donated: the trees prepare checked, written in place
            else:
                stamps.stamp(new_state.params, new_state.compute_params)
        return new_state, metrics

    def prepare(state: TrainState) -> TrainState:
        """``state`` with the compute copy this step will read: its own if current, else
        rebuilt from the params (and stamped); None where no copy is kept."""
        keep = keep_copy and eager_kernels_ok()
        copy = stamps.current_copy(state.params, state.compute_params) if keep else None
        if copy is state.compute_params:
            return state
        if copy is not None:
            stamps.stamp(state.params, copy)
        return state._replace(compute_params=copy)

    def private(state: TrainState) -> TrainState:
        """The host-side work a step traced whole cannot do (:func:`fmp.compile` and
        :func:`fmp.cuda_graph` call this first): find the default per-param policies, and
        copy the tensors a donated step must not write into."""
        if isinstance(state, TrainState):
            cast_p.resolve(state.params)
        return _private_state(state) if donate and isinstance(state, TrainState) else state

    return TrainStep(scaled_loss=scaled_loss, update_phase=update_phase, run=run,
                     prepare=prepare, private=private, stamps=stamps)
