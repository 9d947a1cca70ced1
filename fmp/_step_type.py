"""The train step as a value: :class:`TrainStep`, and the gradient reducer it may take.

:func:`fmp.train_step` builds a :class:`TrainStep`; :func:`fmp.compile` and
:func:`fmp.cuda_graph` recognise it by its type and reach its phases by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class GradReducer(Protocol):
    """What a data-parallel step needs from its communication: reduce grads, agree on them.

    :func:`fmp.train_step` takes one (``reducer=``); ``process_group=g`` builds
    :class:`fmp.distributed.GroupReducer` over ``g``. Both methods must be traceable by
    ``torch.compile(fullgraph=True)`` to compile the step, and must not sync the host.

    Example:
        >>> class Single:  # one process: nothing to reduce or agree on
        ...     def reduce(self, grads): return grads
        ...     def all_finite(self, grads): return fmp.all_finite(grads)
        >>> isinstance(Single(), fmp.GradReducer)
        True
    """

    def reduce(self, grads: Any) -> Any:
        """``grads`` averaged across the replicas (a new tree of the same structure)."""
        ...

    def all_finite(self, grads: Any) -> torch.Tensor:
        """A 0-d bool tensor, the same on every replica: every grad everywhere is finite."""
        ...


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """A train step: ``state, metrics = step(state, *batch)``, made by :func:`fmp.train_step`.

    Frozen; its members are the step's parts, which :func:`fmp.compile` compiles
    separately and :func:`fmp.cuda_graph` prepares the state with. Calling the step is
    ``step.run(state, batch, step.scaled_loss, step.update_phase)``.

    Attributes:
        scaled_loss: ``(params, loss_scale, lead, args, kwargs, cast, float8=None) ->
            (scaled loss, (loss32, aux))``: the forward with its casts (what the backward
            differentiates); ``float8`` is ``(records, probes)`` for float8 layers, or None.
        update_phase: ``(state, batch, grads, loss, aux, model_state, amaxes=None) ->
            (state, metrics)``: unscale, check, update or skip, adjust the loss scale;
            ``amaxes`` (the float8 layers' measured amaxes, None without float8 records)
            join the finite check and update ``state.float8`` on a kept step.
        run: ``(state, batch, scaled_loss, update_phase) -> (state, metrics)``: the whole
            step with the two phases given (compiled ones from :func:`fmp.compile`).
        prepare: ``state -> state`` with the compute copy the step will read (current, or
            rebuilt from the params; None where no copy is kept).
        private: ``state -> state`` a donated step may write into (host-side work a step
            traced whole cannot do).
        stamps: the step's record of the compute copies it wrote (what tells a current copy
            from a stale one; one per step, nothing process-global).
        fused_update: ``state -> bool``: whether the eager update phase runs torch's fused
            in-place optimizer kernels on this state (what :func:`fmp.compile`'s
            ``update="auto"`` asks); None: never.

    Example:
        >>> step = fmp.train_step(lambda p, x: (p["w"] * x).sum(), fmp.optim.sgd(0.1))
        >>> isinstance(step, fmp.TrainStep)
        True
    """

    scaled_loss: Callable[..., Any]
    update_phase: Callable[..., Any]
    run: Callable[..., Any]
    prepare: Callable[..., Any]
    private: Callable[..., Any]
    stamps: Any = None
    fused_update: Callable[[Any], bool] | None = None

    def __call__(self, state: Any, *batch: Any) -> tuple[Any, dict[str, Any]]:
        """One step: ``(new_state, metrics)`` (see :func:`fmp.train_step`)."""
        return self.run(state, batch, self.scaled_loss, self.update_phase)
