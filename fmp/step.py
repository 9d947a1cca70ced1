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
from fmp._compute_copy import current_copy, stamp
from fmp._donation import claim, host_prepared, private
from fmp._eager import eager_kernels_ok
from fmp._grad import grad_with_aux
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

__all__ = ["TrainState", "train_step", "value_and_grad"]


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


class _Phases(NamedTuple):
    """A train step's parts, for :func:`fmp.compile` to compile separately."""

    scaled_loss: Callable[..., Any]  # (params, loss_scale, lead, args, kwargs, cast) -> ...
    update_phase: Callable[..., Any]  # (state, batch, grads, loss, aux, ms) -> (state, m)
    run: Callable[..., Any]  # (state, batch, scaled_loss, update_phase) -> (state, m)
    prepare: Callable[..., Any]  # state -> state with a current compute copy (or None)
    private: Callable[..., Any]  # state -> state a donated step may write into (eager)


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
    mode whenever the dict's names change). One object per step: its identity is what the
    compute copy's stamps record.
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
        leaves = (params.values() if type(params) is dict
                  and all(type(v) is torch.Tensor for v in params.values())
                  else optree.tree_leaves(params))
        if all(v.dtype == want for v in leaves
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
    new_leaves = spec.flatten_up_to(new)
    dst = [o for o, n in zip(old_leaves, new_leaves, strict=True)
           if isinstance(o, torch.Tensor) and o is not n]
    src = [n for o, n in zip(old_leaves, new_leaves, strict=True)
           if isinstance(o, torch.Tensor) and o is not n]
    if dst:
        torch._foreach_copy_(dst, src)
    return old


def _private_state(state: TrainState) -> TrainState:
    """``state`` whose params, optimizer and model state a donated step may write into: a
    copy of every tensor no fmp step handed out (the module's, another state's)."""
    params, opt_state = private(state.params), private(state.opt_state)
    model_state = private(state.model_state)
    if (params is state.params and opt_state is state.opt_state
            and model_state is state.model_state):
        return state
    return state._replace(params=params, opt_state=opt_state, model_state=model_state,
                          compute_params=(state.compute_params if params is state.params
                                          else None))


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    policy: str | Policy = "fp32",
    accumulate: int = 1,
    donate: bool = False,
    process_group: Any = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    autocast: bool = False,
    param_policies: Mapping[str, Policy] | None = None,
    compute_copy: bool = True,
    cast_batch: CastBatch = True,
) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
    """Build ``step(state, *batch) -> (new_state, metrics)``: one skip-safe update.

    The step computes grads with :func:`value_and_grad`, runs the optimizer, and keeps the
    new params and optimizer state only when every grad is finite (a branch-free
    ``torch.where`` select, so a skipped step returns them bit-identical). The loss scale
    adjusts on every step. Nothing in it synchronises the host: it runs under
    ``torch.cuda.set_sync_debug_mode("error")``, ``torch.compile(fullgraph=True)`` and
    CUDA-graph capture. A non-finite step is skipped whatever the loss scale (a NaN is
    never applied, also under ``NoOpLossScale``).

    Args:
        loss_fn: ``loss_fn(params, *batch) -> loss`` (params already cast to the compute
            dtype, floating batch leaves too). With ``has_state``: ``loss_fn(params,
            model_state, *batch) -> (loss, new_model_state)``. With ``has_aux`` the loss is
            followed by ``aux``: ``(loss, aux)``, or ``(loss, (new_model_state, aux))``.
        optimizer: a :class:`fmp.optim.GradientTransformation`.
        policy: a :class:`fmp.Policy` or a spec for :func:`fmp.get_policy`.
        accumulate: split the batch into this many equal micro-batches along dim 0; their
            grads are summed in float32 and averaged, then one update is made (equal to one
            step on the whole batch with a mean loss). The loss scale moves once per step.
        donate: write the new params, optimizer state and model state into the input
            state's tensors in place (saves memory; the input state is consumed, and so is
            any state made from it with ``_replace``). Only tensors a donated step
            returned (and the fresh optimizer state of ``TrainState.create``) are written
            into: the first donated call copies the others once (params and buffers from
            :func:`fmp.functional`, which share storage with the module, a tree another
            state also holds, a pure step's output), so the module and other states keep
            their values. With
            :func:`fmp.optim.sgd`, :func:`~fmp.optim.adam` or :func:`~fmp.optim.adamw` on
            uniform-dtype trees this runs torch's fused kernel, which unscales, updates and
            skips in one pass.
        process_group: a ``torch.distributed`` process group (or ``"default"`` for the
            default group) to make the step data-parallel: grads are averaged across ranks
            (:func:`fmp.distributed.all_reduce_grads`, bucketed) and the finite verdict is
            agreed (:func:`fmp.distributed.all_finite`), so every rank skips together. The
            reported loss is the local one. None: single process.
        has_aux: ``loss_fn`` also returns an auxiliary value, returned as ``metrics["aux"]``.
            With ``accumulate=k > 1`` it holds all k micro-batches' values, in order: each
            tensor leaf stacked along a new leading dim of size k (``aux["acc"].mean()`` is
            the batch's), each other leaf a tuple of the k values.
        has_state: ``loss_fn`` takes and returns model state (``TrainState.model_state``);
            a skipped step keeps the old model state. Models whose forward updates
            buffers (BatchNorm in training mode) need it: an ``apply_fn`` from
            :func:`fmp.functional` raises inside the step when it would update the
            module's buffers (or given ones) in place, which a skipped step could not undo.
        autocast: also run ``loss_fn`` under ``torch.autocast`` at the compute dtype.
        param_policies: per-parameter policies (from :func:`fmp.module_policies`). None:
            ``policy`` for every param, except that under a mixed policy with float32
            params the norm layers of a module given to :func:`fmp.functional` (found by
            the params' names and shapes) keep float32, as ``module_policies`` does.
        compute_copy: where the policy casts params to another compute dtype, keep the cast
            params in ``TrainState.compute_params``, written by the update (fused with the
            param write when compiled), so the next forward reads them instead of casting
            and the grads come back in the compute dtype, converted in the update. Results
            are bit-identical to casting every step. The copy is used only when the step
            can tell it is current: written by this step from these param tensors, neither
            modified in place since; otherwise it is rebuilt from the params (so replacing
            or editing params is safe, except writes through ``.data``, which version
            counters do not see: then pass ``state._replace(compute_params=None)``). Steps
            traced whole by ``torch.compile`` or run inside a torch.func transform cast
            every step and return ``compute_params=None``. False: always cast.
        cast_batch: which batch arguments' floating leaves are cast to the compute dtype:
            True (all), False (none) or one bool per positional batch argument, e.g.
            ``(True, False)`` to cast ``x`` and keep a float32 target ``y`` as it is. The
            first eager call warns (``RuntimeWarning``) when the cast turns a finite
            value into inf (a float16 target of 70000: every such step would be skipped).

    Returns:
        ``step(state, *batch) -> (new_state, metrics)``; ``metrics`` is a dict of tensors:
        ``loss`` (unscaled float32, mean over micro-batches), ``grads_finite`` (bool),
        ``skipped`` (bool), ``loss_scale`` (float32, the scale after this step's
        adjustment), ``skipped_total`` (int32), and ``aux`` with ``has_aux``; with a
        learning-rate schedule also ``lr_ok`` (bool): False when the scheduled rate was inf,
        NaN or negative, and the step was then skipped (:func:`fmp.optim.schedule_ok`).

    Raises:
        ValueError: ``accumulate`` is not a positive int; ``cast_batch`` is not a bool or a
            sequence of bools; a batch's leading size is not divisible by ``accumulate``,
            or ``cast_batch`` has not one entry per batch argument (when called).
        TypeError: ``optimizer`` is not a GradientTransformation; ``param_policies`` is
            not a dict of :class:`fmp.Policy`; (when called) the optimizer state was made by
            another optimizer.
        RuntimeError: ``process_group`` is given but torch.distributed is not initialised.

    Example:
        >>> net = torch.nn.Linear(4, 1)
        >>> apply_fn, params, _ = fmp.functional(net)
        >>> def loss_fn(p, x, y):
        ...     return torch.nn.functional.mse_loss(apply_fn(p, x).float(), y)
        >>> opt = fmp.optim.adamw(1e-2)
        >>> step = fmp.train_step(loss_fn, opt, "bf16-mixed")
        >>> state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create())
        >>> state, metrics = step(state, torch.randn(8, 4), torch.randn(8, 1))
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(f"optimizer must be an fmp.optim.GradientTransformation, got "
                        f"{type(optimizer).__name__}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
    check_param_policies(param_policies, "train_step")
    reduce_grads = grads_finite = None
    if process_group is not None:
        from fmp import distributed as dist_

        group = None if process_group == "default" else process_group
        dist_.check_group(group)

        def reduce_grads(g: Any) -> Any:
            return dist_.all_reduce_grads(g, group=group, op="mean")

        def grads_finite(g: Any) -> torch.Tensor:
            return dist_.all_finite(g, group=group)
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
            stamp(new_state.params, new_state.compute_params, cast_p)
        return new_state, metrics

    def prepare(state: TrainState) -> TrainState:
        """``state`` with the compute copy this step will read: its own if current, else
        rebuilt from the params (and stamped); None where no copy is kept."""
        keep = keep_copy and eager_kernels_ok()
        copy = current_copy(state.params, state.compute_params, cast_p) if keep else None
        if copy is state.compute_params:
            return state
        if copy is not None:
            stamp(state.params, copy, cast_p)
        return state._replace(compute_params=copy)

    def step(state: TrainState, *batch: Any) -> tuple[TrainState, dict[str, Any]]:
        return run(state, batch, scaled_loss, update_phase)

    def private(state: TrainState) -> TrainState:
        """The host-side work a step traced whole cannot do (:func:`fmp.compile` and
        :func:`fmp.cuda_graph` call this first): find the default per-param policies, and
        copy the tensors a donated step must not write into."""
        if isinstance(state, TrainState):
            cast_p.resolve(state.params)
        return _private_state(state) if donate and isinstance(state, TrainState) else state

    step._fmp_phases = _Phases(scaled_loss, update_phase, run, prepare,  # type: ignore[attr-defined]
                               private)
    return step
