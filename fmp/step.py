"""The pure train step: value_and_grad under a policy and loss scale, then a skip-safe update.

:func:`build_train_step` makes the :class:`TrainStep` (:func:`fmp.train_step` is it, with a
``process_group`` turned into the reducer); the record it steps is :class:`TrainState`
(``fmp/_train_state.py``), the forward and its casts are ``fmp/_value_and_grad.py``, the
whole-tree helpers ``fmp/_step_trees.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from fmp._batch_cast import CastBatch, check_cast_batch, warn_cast_overflow
from fmp._checks import check_param_policies
from fmp._compute_copy import CopyStamps
from fmp._donation import check_not_consumed, claim, consume, host_prepared
from fmp._eager import eager_kernels_ok
from fmp._grad import grad_with_aux
from fmp._step_trees import (
    check_param_dtypes,
    donate_into,
    private_state,
    select_into,
    split_batch,
    stack_aux,
    to_f32,
)
from fmp._step_type import GradReducer, TrainStep
from fmp._train_state import TrainState
from fmp._value_and_grad import Caster, scaled_loss_fn, value_and_grad
from fmp.float8 import _step as _float8
from fmp.optim import (
    GradientTransformation,
    apply_updates,
    in_place_plan,
    schedule_ok,
    update_in_place,
)
from fmp.policy import Policy, get_policy
from fmp.tree import select_tree, to_dtypes_of

__all__ = ["GradReducer", "TrainState", "TrainStep", "value_and_grad"]


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

    cast_p = Caster(pol, param_policies)
    stamps = CopyStamps(cast_p)  # this step's record of the copies it wrote
    scaled_loss = scaled_loss_fn(wrapped, pol, True, autocast, cast_p, cast_batch,
                                  skip_safe=True)
    # params are checked to be in their param dtypes, so whether the cast changes any of
    # them is known now: where it changes none there is no copy to keep or check
    pols = [pol] if param_policies is None else list(param_policies.values())
    keep_copy = compute_copy and any(q.compute_dtype != q.param_dtype for q in pols)

    def grad_phase(state: TrainState, batch: tuple[Any, ...], loss_impl: Callable[..., Any]
                   ) -> tuple[Any, Any, Any, Any, Any]:
        """-> (summed scaled grads, mean loss, aux, new model state, float8 amaxes), nothing
        applied yet (the amaxes: None without float8 records)."""
        micro = split_batch(batch, accumulate)
        model_state = state.model_state
        copy = state.compute_params
        grad_sum: Any = None
        loss_sum: Any = None
        aux = None
        auxes = []
        f8 = state.float8
        amaxes = None
        for mb in micro:
            lead = (model_state,) if has_state else ()
            if f8 is None:
                grads, (loss, (new_ms, aux)) = grad_with_aux(
                    lambda p, _l=lead, _b=mb: loss_impl(p, state.loss_scale, _l, _b, {},
                                                        copy is None),
                    state.params if copy is None else copy)
            else:  # the probes' grads are the float8 layers' amaxes (fmp/float8/_step.py)
                probes = _float8.probes(f8)
                (grads, got), (loss, (new_ms, aux)) = grad_with_aux(
                    lambda pp, _l=lead, _b=mb: loss_impl(pp[0], state.loss_scale, _l, _b, {},
                                                         copy is None, (f8, pp[1])),
                    (state.params if copy is None else copy, probes))
                amaxes = _float8.combine(amaxes, got)  # micro-batches: the max
            if has_state:
                model_state = new_ms
            auxes.append(aux)
            if accumulate == 1:
                grad_sum, loss_sum = grads, loss
            else:
                if copy is not None:  # as the cast's backward would have: to param dtypes
                    grads = to_dtypes_of(grads, state.params)
                g32 = optree.tree_map(to_f32, grads)
                grad_sum = g32 if grad_sum is None else optree.tree_map(torch.add, grad_sum, g32)
                loss_sum = loss if loss_sum is None else loss_sum + loss
        loss = loss_sum if accumulate == 1 else loss_sum * (1.0 / accumulate)
        if has_aux and accumulate > 1:
            aux = stack_aux(auxes)
        return grad_sum, loss, aux, model_state, amaxes

    def update_phase(state: TrainState, batch: tuple[Any, ...], grad_sum: Any, loss: Any,
                     aux: Any, model_state: Any, amaxes: Any = None
                     ) -> tuple[TrainState, dict[str, Any]]:
        """Unscale, check, update (or skip), adjust the scale: the rest of the step
        (``amaxes``: the float8 layers', which update ``state.float8`` where finite)."""
        # grads of the compute copy go to their params' dtypes (the cast's backward): here
        # where the fused kernel or a reducer takes them; else in the unscale, whose check
        # reads them unconverted, so that compiled, the conversion fuses into the update
        like = unconverted = None
        if state.compute_params is not None and accumulate == 1:
            if reduce_grads is not None or (donate and eager_kernels_ok()):
                if reduce_grads is None:  # the fused path's verdict may read these
                    unconverted = grad_sum
                grad_sum = to_dtypes_of(grad_sum, state.params)
            else:
                like = state.params
        lr_ok = schedule_ok(optimizer, state.opt_state)  # a scheduled lr of inf/NaN/< 0 skips
        # float8 amaxes (None without records) join the finite verdict: with a reducer in
        # its all_finite, so every replica agrees
        check = grads_finite
        f8_ok = None
        if amaxes is not None and grads_finite is not None:
            check = lambda g: grads_finite((g, amaxes))  # noqa: E731
        elif amaxes is not None:
            f8_ok = _float8.amaxes_finite(amaxes)
        plan = (in_place_plan(optimizer, state.params, grad_sum, state.opt_state)
                if donate else None)
        # what a grad could share storage with: what loss_fn sees (params or their copy,
        # model state, batch); the optimizer state never reaches it, so it is not scanned
        seen = (state.params, state.compute_params, state.model_state, batch)
        if plan is not None:
            # One in-place pass unscales and checks the step's own grads (where the amp kernel
            # cannot, a read-only check and the fused kernel divides by the scale; with
            # nothing to divide, a read-only check of the grads before their conversion);
            # torch's fused kernel then updates params and moments in place, or skips.
            grads = grad_sum if reduce_grads is None else reduce_grads(grad_sum)
            grads, divisor, finite = state.loss_scale.unscale_for_fused(
                grads, micro_batches=accumulate, protect=seen, check=check,
                read_from=unconverted)
            finite = finite if f8_ok is None else finite & f8_ok  # a saturated inf
            grads_ok, finite = finite, finite if lr_ok is None else finite & lr_ok
            opt_state = update_in_place(optimizer, state.params, grads, state.opt_state,
                                        divisor, (~finite).to(torch.float32), plan=plan)
            claim(opt_state)  # its new leaves (the count): the next call need not copy them
            params = state.params
        else:
            if reduce_grads is None:  # eager: the same one-pass unscale where it applies
                grads, finite = state.loss_scale.unscale_and_check(
                    grad_sum, in_place=eager_kernels_ok(), micro_batches=accumulate,
                    protect=seen, like=like)
            else:
                grads = reduce_grads(state.loss_scale.unscale(grad_sum, micro_batches=accumulate))
                finite = check(grads)
            finite = finite if f8_ok is None else finite & f8_ok  # a saturated inf
            grads_ok, finite = finite, finite if lr_ok is None else finite & lr_ok
            updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
            new_params = apply_updates(state.params, updates)
            if donate:  # the select written into the input state's tensors (one walk each)
                params = select_into(finite, new_params, state.params)
                opt_state = select_into(finite, new_opt_state, state.opt_state)
            else:
                params = select_tree(finite, new_params, state.params)
                opt_state = select_tree(finite, new_opt_state, state.opt_state)
        if has_state:
            model_state = (select_into(finite, model_state, state.model_state) if donate
                           else select_tree(finite, model_state, state.model_state))
        copy = state.compute_params
        if copy is not None:  # the next step's forward reads this instead of casting
            copy = donate_into(copy, params) if donate else cast_p(params)
        loss_scale = state.loss_scale.adjust(grads_ok)
        skipped = ~finite
        prev_skipped = state.skipped_total
        if prev_skipped is None:
            prev_skipped = torch.zeros((), dtype=torch.int32, device=finite.device)
        skipped_total = prev_skipped + skipped.to(torch.int32)
        float8 = _float8.updated(state.float8, amaxes, finite)  # skipped: as they were
        new_state = TrainState(params=params, opt_state=opt_state, loss_scale=loss_scale,
                               step=state.step + 1, model_state=model_state,
                               skipped_total=skipped_total, compute_params=copy,
                               float8=float8)
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
        check_param_dtypes(state.params, pol, param_policies)
        if reducer is not None:
            _float8.check_no_delayed(state.float8)
        cast_p.resolve(state.params)
        if donate and not torch.compiler.is_compiling():
            check_not_consumed(state.step, "fmp.train_step")
            state = private_state(state)
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
        if donate and not torch.compiler.is_compiling():
            consume(state.step)
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
        return private_state(state) if donate and isinstance(state, TrainState) else state

    def fused_update(state: Any) -> bool:
        """Whether the eager update phase would run torch's fused in-place kernels on this
        state (a donated step; uniform params and moments; the params stand in for the
        grads, which the update phase brings to the params' dtypes and layouts)."""
        if not (donate and isinstance(state, TrainState) and eager_kernels_ok()):
            return False
        return in_place_plan(optimizer, state.params, state.params,
                             state.opt_state) is not None

    return TrainStep(scaled_loss=scaled_loss, update_phase=update_phase, run=run,
                     prepare=prepare, private=private, stamps=stamps,
                     fused_update=fused_update)
