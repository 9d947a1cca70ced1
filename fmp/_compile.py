"""``fmp.compile``: torch.compile for a train step, with the workarounds fmp knows of."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fmp._donation import prepared_on_host
from fmp._step_type import TrainStep
from fmp._train_state import TrainState


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def inductor_workarounds() -> dict[str, Any]:
    """Inductor settings fmp applies when it compiles a step on this torch version.

    torch 2.11's inductor (CUDA) raises ``AssertionError`` in
    ``ForeachKernelSchedulerNode.reorder_loops_by_dep_pair`` when one graph mixes
    ``torch._foreach_*`` ops with per-tensor reductions over tensors of different shapes
    (pytorch/pytorch#176591, fixed upstream by #176849): a train step's update does exactly
    that (the foreach update beside each grad's inf-norm for the overflow verdict). With
    the ``loop_ordering_after_fusion`` pass off the step compiles and runs at the same
    speed. It is turned off for torch older than 2.13; 2.13 and newer get no change.

    :func:`fmp.compile` applies these around every compile. A plain
    ``torch.compile(step)`` on torch 2.11 needs them too, around its first call (where
    inductor compiles)::

        with torch._inductor.config.patch(fmp.inductor_workarounds()):
            state, metrics = compiled(state, *batch)

    Returns:
        A dict of ``torch._inductor.config`` names and values (empty when none apply).

    Example:
        >>> isinstance(fmp.inductor_workarounds(), dict)
        True
    """
    if _torch_version() < (2, 13):
        return {"loop_ordering_after_fusion": False}
    return {}


#: Inductor settings for the two graphs of an fmp train step. combo_kernels fuses the
#: step's many small independent kernels (one cast per param in the forward, one grad
#: conversion per param in the backward) horizontally: on the GPT-2 step on an H200 it ran
#: 744 kernels instead of 994 and 0.3 ms (0.9%) faster (benchmarks/NOTES.md, v7).
STEP_OPTIONS: dict[str, Any] = {"combo_kernels": True}

#: Inductor settings for the update graph alone. Its per-leaf chains (unscale, check,
#: optimizer, select, copy: GPT-2 small, 1647 FX ops) all read the same few 0-d tensors
#: (the scale, the verdict, the step count), so inductor's fusion search puts every node
#: in one buffer group and tries 64 neighbours of each: on an H100 its scheduler took
#: 33.7 s (fused_nodes 22.8 s) of the update's 64 s compile, Triton 5.9 s
#: (benchmarks/compile_time.py). The fusions that matter pair a leaf's own chain, whose
#: nodes share the leaf's buffers in small groups. With 16 neighbours: the same kernels
#: and bit-identical params on CPU (6-layer GPT: fused_nodes 15.9 -> 5.9 s).
UPDATE_OPTIONS: dict[str, Any] = {"max_fusion_buffer_group_pairwise_attempts": 16}


def _graph_break_errors() -> tuple[type[BaseException], ...]:
    """The exception dynamo raises where ``fullgraph=True`` meets a graph break."""
    exc = getattr(getattr(torch, "_dynamo", None), "exc", None)
    err = getattr(exc, "Unsupported", None)
    return (err,) if isinstance(err, type) else ()


class _LossGraph:
    """The compiled scaled loss: fullgraph first; on a graph break, once, a warning naming
    the break and a recompile that allows breaks (``loss_fullgraph=None``)."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any],
                 loss_fullgraph: bool | None) -> None:
        self.fn, self.kwargs, self.fallback = fn, kwargs, loss_fullgraph is None
        full = kwargs.get("fullgraph", True) if loss_fullgraph is None else loss_fullgraph
        self.fallback = self.fallback and bool(full)
        self.compiled = torch.compile(fn, **{**kwargs, "fullgraph": bool(full)})

    def __call__(self, *args: Any) -> Any:
        if not self.fallback:
            return self.compiled(*args)
        try:
            return self.compiled(*args)
        except _graph_break_errors() as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            where = next((ln for ln in reversed(lines) if ln.startswith("File ")), "")
            warnings.warn(
                f"fmp.compile: the loss graph breaks ({lines[0] if lines else e!r}"
                f"{'; last frame: ' + where if where else ''}); compiling the loss phase "
                "with fullgraph=False, the update graph stays fullgraph. Pass "
                "loss_fullgraph=False to allow the breaks without this warning, or True to "
                "raise instead",
                stacklevel=3,
            )
            self.fallback = False
            self.compiled = torch.compile(self.fn, **{**self.kwargs, "fullgraph": False})
            return self.compiled(*args)


_CODES = itertools.count()


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls ``fn``, with a code object of its own.

    Dynamo keeps its compiled code per code object. The parts of two train steps share
    theirs (closures of one ``def``; a callable object is compiled through torch's one
    wrapper), so a second step compiled in the process would recompile the first's entry,
    mark the shapes that differ dynamic (slower kernels; on torch 2.11 the guard of such a
    recompile can crash) and count against one cache limit. Automatic dynamic shapes
    key their memory by the code's file, line and name, so the name is unique too.
    """

    def call(*args: Any) -> Any:
        return fn(*args)

    name = f"{getattr(fn, '__name__', type(fn).__name__)}_{next(_CODES)}"
    code = call.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, call.__globals__, name, call.__defaults__,
                              call.__closure__)


def _split_step(step: TrainStep, kwargs: dict[str, Any], loss_fullgraph: bool | None = None,
                update: str = "compiled", resolved: list[str] | None = None
                ) -> Callable[..., Any]:
    """A train step as two compiled graphs: the scaled loss (AOTAutograd splits its forward
    and backward; autograd runs the backward) and the update (unscale, check, optimizer,
    select, loss scale); with ``update="eager"`` the update phase runs uncompiled, with
    ``"auto"`` as :func:`fmp.compile` says (``resolved``, if given, gets "compiled" or
    "eager" on the first call)."""
    loss_c = _LossGraph(_own_code(step.scaled_loss), kwargs, loss_fullgraph)

    def compiled_update() -> Callable[..., Any]:
        return _patched(torch.compile(_own_code(step.update_phase), **kwargs),
                        _known(UPDATE_OPTIONS))

    if update == "eager":
        update_c = step.update_phase
    elif update == "compiled":
        update_c = compiled_update()
    else:  # "auto": decided on the first call, from the state it is given
        chosen: list[Callable[..., Any]] = []

        def update_c(state: Any, *rest: Any) -> Any:
            if not chosen:
                fused = step.fused_update is not None and step.fused_update(state)
                chosen.append(step.update_phase if fused else compiled_update())
                if resolved is not None:
                    resolved.append("eager" if fused else "compiled")
            return chosen[0](state, *rest)

    def run(state: Any, *batch: Any) -> Any:
        return step.run(state, batch, loss_c, update_c)

    return run


def _whole_step(step: TrainStep, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """A train step as one compiled graph, after the host-side work a step traced whole
    cannot do (norm policies, copies of tensors a donated step must not write)."""
    whole = torch.compile(_own_code(step), **kwargs)

    def run(state: Any, *batch: Any) -> Any:
        state = step.private(state)
        if isinstance(state, TrainState) and state.compute_params is not None:
            # a step traced whole keeps no compute copy (it casts inside the graph): drop
            # one the caller holds, so a state with and one without share one trace instead
            # of recompiling (a recompile inside fmp.cuda_graph's capture cannot run)
            state = state._replace(compute_params=None)
        with prepared_on_host():
            return whole(state, *batch)

    return run


def _known(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` this torch's inductor has (an older one lacks some)."""
    import torch._inductor.config as inductor_config

    return {k: v for k, v in options.items() if hasattr(inductor_config, k)}


def _patched(fn: Callable[..., Any], patch: Mapping[str, Any]) -> Callable[..., Any]:
    """``fn`` run under ``torch._inductor.config.patch(patch)`` (``fn`` itself if empty)."""
    if not patch:
        return fn
    patch = dict(patch)

    def run(*args: Any, **kw: Any) -> Any:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(patch):
            return fn(*args, **kw)

    return run


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledStep:
    """A :class:`fmp.TrainStep` compiled by :func:`fmp.compile`: ``state, metrics =
    compiled(state, *batch)``, the eager step's results.

    Frozen. :func:`fmp.cuda_graph` recognises it and prepares the state through ``step``.

    Attributes:
        step: the :class:`fmp.TrainStep` it compiles.
        whole_graph: compiled as one graph (True) or as the loss and update graphs.
        call: the compiled ``(state, *batch) -> (state, metrics)`` it runs.
        update: ``"compiled"``, ``"eager"`` or ``"auto"``: how the two-graph step runs
            its update phase, as asked (see :func:`fmp.compile`).
        resolved: for ``"auto"``, what it came to (``["compiled"]`` or ``["eager"]``;
            empty until the first call decides); read it as :attr:`update_used`.

    Example:
        >>> step = fmp.train_step(lambda p, x: (p["w"] * x).sum(), fmp.optim.sgd(0.1))
        >>> isinstance(fmp.compile(step, backend="eager"), fmp.CompiledStep)
        True
    """

    step: TrainStep
    whole_graph: bool
    call: Callable[..., Any]
    update: str = "compiled"
    resolved: list[str] = dataclasses.field(default_factory=list, repr=False)

    @property
    def update_used(self) -> str | None:
        """``"compiled"`` or ``"eager"``: how the update phase runs (None for ``"auto"``
        before the first call; ``"compiled"`` for ``whole_graph=True``, one graph)."""
        if self.whole_graph:
            return "compiled"
        if self.update != "auto":
            return self.update
        return self.resolved[0] if self.resolved else None

    def __call__(self, state: Any, *batch: Any) -> tuple[Any, dict[str, Any]]:
        """One compiled step: ``(new_state, metrics)``."""
        return self.call(state, *batch)


_UPDATES = ("compiled", "eager", "auto")


def compile(fn: Callable[..., Any], *, whole_graph: bool = False,
            loss_fullgraph: bool | None = None, update: str = "compiled",
            **kwargs: Any) -> Callable[..., Any]:
    """Compile a train step (or any function) with torch.compile and fmp's workarounds.

    A :class:`fmp.TrainStep` (what :func:`fmp.train_step` returns, not a wrapper around
    it) is compiled as two graphs by default: the loss with its casts, whose forward and
    backward AOTAutograd partitions (its min-cut partitioner picks what the backward keeps
    and recomputes; one graph kept a second logits-sized buffer alive on the GPT-2 step:
    10.3 GB at the peak against 8.5) and autograd runs, then the update (unscale, finite
    check, optimizer, skip select, loss-scale adjustment, donation). Both are
    ``fullgraph=True``; neither synchronises the host, and the pair can be captured in one
    CUDA graph. A loss that dynamo cannot trace whole (third-party models: a logging call
    inside Hugging Face transformers' loss, a ``print``) would fail under
    ``fullgraph=True``; by default (``loss_fullgraph=None``) the loss phase then warns once,
    naming the break, and is recompiled with ``fullgraph=False`` (its pieces compiled, the
    break run eagerly); the update graph stays ``fullgraph=True`` and sync-free.
    ``whole_graph=True`` compiles the step as one graph instead (``torch.func.grad``
    traced inside it), as any other ``fn`` is compiled:
    ``torch.compile(fn, fullgraph=True, **kwargs)``. Both give the eager step's results.
    The two-graph form also turns on inductor's horizontal fusion of small kernels
    (``STEP_OPTIONS``).

    ``update="eager"`` compiles the loss graph only and runs the update phase as the eager
    step does. For a donated step (``fmp.train_step(..., donate=True)``) with :func:`sgd`
    (no dampening), :func:`adam` or :func:`adamw` over uniform trees, that is torch's fused
    multi-tensor kernels, in place: the same results, no host sync (capturable by
    :func:`fmp.cuda_graph`), and no inductor compile of the update, the larger part of a
    cold build (GPT-2 small in one CUDA graph on an H100: built in about 24 s instead of 72
    (fp16) or 118 (bf16), and 0.9-1.0 ms a step faster; benchmarks/RESULTS.md). Otherwise
    the update's foreach ops run one kernel each, which costs GPU time that the compiled
    update fuses away. ``update="auto"`` decides on the first call, from the state it is
    given: eager where the update phase would run those fused kernels
    (:attr:`TrainStep.fused_update`), else compiled; :attr:`CompiledStep.update_used` then
    says which. Either way the step gives the eager step's results.

    The workarounds (:func:`inductor_workarounds`) and options are applied around every call
    (compilation happens on the first calls and on recompiles), as a
    ``torch._inductor.config.patch``; they do not leak to other compiled code.

    Args:
        fn: the function to compile, typically a step from :func:`fmp.train_step` (a
            :class:`CompiledStep` is compiled afresh from its step).
        whole_graph: compile an fmp train step as one graph (forward, backward and update
            in one inductor graph, no partitioner); the loss must then trace whole.
        loss_fullgraph: for the two-graph step, the loss phase's ``fullgraph``: None
            (default) tries True and falls back to False with a warning on a graph break;
            True raises on a break; False allows breaks silently.
        update: for the two-graph step, ``"compiled"`` (default), ``"eager"`` (the
            update phase uncompiled) or ``"auto"`` (eager where it runs fused, in place;
            see above). With ``whole_graph=True`` or a function that is not a train step,
            ``"auto"`` is accepted and means compiled (one graph).
        **kwargs: passed to ``torch.compile`` (``fullgraph`` defaults to True here).

    Returns:
        For a :class:`fmp.TrainStep`, a :class:`fmp.CompiledStep`; else the compiled
        function.

    Raises:
        ValueError: ``update`` is not one of ``"compiled"``, ``"eager"``, ``"auto"``, or is
            ``"eager"`` with ``whole_graph=True`` (one graph holds the update) or with
            ``fn`` not a train step.

    Example:
        >>> step = fmp.compile(lambda x: x * 2, backend="eager")
        >>> float(step(torch.ones(())))
        2.0
    """
    if update not in _UPDATES:
        raise ValueError(f"fmp.compile: update={update!r} is not accepted; use one of "
                         f"{', '.join(map(repr, _UPDATES))}")
    kwargs.setdefault("fullgraph", True)
    patch = inductor_workarounds()
    if isinstance(fn, CompiledStep):  # compiled afresh from its step, with these options
        fn = fn.step
    if update == "eager" and (whole_graph or not isinstance(fn, TrainStep)):
        raise ValueError(
            "fmp.compile: update='eager' needs a two-graph fmp.train_step (the loss compiled, "
            "the update phase eager); "
            + ("whole_graph=True traces the update into the one graph" if whole_graph
               else f"got {type(fn).__name__}, not a TrainStep"))
    if isinstance(fn, TrainStep):
        resolved: list[str] = []
        if whole_graph:
            call = _whole_step(fn, kwargs)
        else:
            call = _split_step(fn, kwargs, loss_fullgraph, update, resolved)
            patch.update(STEP_OPTIONS)
        return CompiledStep(step=fn, whole_graph=whole_graph, call=_patched(call, patch),
                            update=update, resolved=resolved)
    compiled = torch.compile(fn, **kwargs)
    if not patch:
        return compiled
    return functools.wraps(fn)(_patched(compiled, patch))
