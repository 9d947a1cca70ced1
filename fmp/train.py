"""``fmp.train_step``: the step of :mod:`fmp.step`, data-parallel over a process group.

The one module that knows both the step and :mod:`fmp.distributed`: it turns a
``process_group`` into the step's gradient reducer, so the step itself depends on no
communication library (data parallelism sits above it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fmp._batch_cast import CastBatch
from fmp._step_type import GradReducer, TrainStep
from fmp.distributed import GroupReducer
from fmp.optim import GradientTransformation
from fmp.policy import Policy
from fmp.step import build_train_step, check_step_args

__all__ = ["train_step"]


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
    reducer: GradReducer | None = None,
) -> TrainStep:
    """Build ``step(state, *batch) -> (new_state, metrics)``: one skip-safe update.

    The step computes grads with :func:`fmp.value_and_grad`, runs the optimizer, and keeps the
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
            their values; ``TrainState.create(..., donate=True)`` hands params and buffers
            over instead (no copy: the module follows the updates in place). With
            :func:`fmp.optim.sgd`, :func:`~fmp.optim.adam` or :func:`~fmp.optim.adamw` on
            uniform-dtype trees this runs torch's fused kernel, which unscales, updates and
            skips in one pass.
        process_group: a ``torch.distributed`` process group (or ``"default"`` for the
            default group) to make the step data-parallel: grads are averaged across ranks
            (:func:`fmp.distributed.all_reduce_grads`, bucketed) and the finite verdict is
            agreed (:func:`fmp.distributed.all_finite`), so every rank skips together. The
            reported loss is the local one. None: single process. The same as
            ``reducer=fmp.distributed.GroupReducer(process_group)``.
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

        reducer: the data parallelism as an object (:class:`fmp.GradReducer`): the step
            averages its grads with ``reducer.reduce(grads)`` and agrees on the finite
            verdict with ``reducer.all_finite(grads)``, at the points ``process_group``
            does. For communication other than ``fmp.distributed``'s; not with
            ``process_group``.

    Returns:
        A :class:`fmp.TrainStep` (frozen), called as
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
        TypeError: both ``process_group`` and ``reducer`` are given, or ``reducer`` lacks
            ``reduce``/``all_finite``.

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
    check_step_args(optimizer, accumulate, param_policies)
    if process_group is not None:
        if reducer is not None:
            raise TypeError("train_step: pass process_group or reducer, not both "
                            f"(got process_group={process_group!r} and a "
                            f"{type(reducer).__name__} reducer)")
        reducer = GroupReducer(process_group)
    return build_train_step(loss_fn, optimizer, policy, accumulate, donate, reducer,
                            has_aux=has_aux, has_state=has_state, autocast=autocast,
                            param_policies=param_policies, compute_copy=compute_copy,
                            cast_batch=cast_batch)
