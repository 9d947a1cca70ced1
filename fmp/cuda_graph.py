"""``fmp.cuda_graph``: a train step captured once in a CUDA graph and replayed every call."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from fmp._batched import copy_groups, foreach_copy_
from fmp._compile import CompiledStep
from fmp._donation import prepared_on_host, release
from fmp._step_trees import donate_into
from fmp._step_type import TrainStep
from fmp.step import TrainState

__all__ = ["GraphedStep", "cuda_graph"]


def _clone(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _check_cuda(what: str, tree: Any) -> None:
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    for acc, x in zip(accessors, leaves, strict=True):
        if isinstance(x, torch.Tensor) and x.device.type != "cuda":
            raise ValueError(f"fmp.cuda_graph: {acc.codify(what)} is on {x.device}; a CUDA "
                             "graph replays CUDA work only: move the state and the batch "
                             "to a CUDA device first")


def _copy_into(what: str, dst: Any, src: Any) -> None:
    """Copy ``src``'s tensor leaves into ``dst``'s (same structure, shapes and dtypes)."""
    d_leaves, d_spec = optree.tree_flatten(dst)
    s_leaves, s_spec = optree.tree_flatten(src)
    if d_spec != s_spec:
        raise ValueError(f"fmp.cuda_graph: the {what} does not have the structure it was "
                         f"captured with: {s_spec} instead of {d_spec}")
    pairs = []
    for i, (d, s) in enumerate(zip(d_leaves, s_leaves, strict=True)):
        if isinstance(d, torch.Tensor):
            if not isinstance(s, torch.Tensor) or s.shape != d.shape or s.dtype != d.dtype:
                got = (f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor)
                       else type(s).__name__)
                raise ValueError(f"fmp.cuda_graph: {what} leaf {i} is {got}; the graph was "
                                 f"captured with {d.dtype} {tuple(d.shape)} (capture "
                                 "another graph for other shapes)")
            if s is not d:
                pairs.append((d, s))
        elif s != d:
            raise ValueError(f"fmp.cuda_graph: {what} leaf {i} is {s!r}; the graph was "
                             f"captured with {d!r} (non-tensor values are fixed at capture)")
    if pairs:
        foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def _tensor_refs(tree: Any) -> tuple[Any, list[Any]] | None:
    """Weak references to ``tree``'s tensor leaves and its treespec (None for None): what
    recognises that very state later without keeping its memory alive."""
    if tree is None:
        return None
    leaves, spec = optree.tree_flatten(tree)
    return spec, [weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]


def _is_state(refs: tuple[Any, list[Any]] | None, tree: Any) -> bool:
    """``tree`` is the state ``refs`` were taken of: same structure, the same tensors."""
    if refs is None:
        return False
    spec, wanted = refs
    leaves, got = optree.tree_flatten(tree)
    if got != spec or not any(isinstance(w, weakref.ref) for w in wanted):
        return False
    return all((w() is x) if isinstance(w, weakref.ref) else True
               for w, x in zip(wanted, leaves, strict=True))


class GraphedStep:
    """A train step captured in one CUDA graph: ``state, metrics = graphed(state, *batch)``.

    Made by :func:`cuda_graph`. A call copies the batch into the graph's input tensors,
    replays the graph and writes the new state into the graph's state tensors, which it
    returns: pass that state back in and nothing else is copied. Any other state of the
    same structure is copied in first (its compute copy rebuilt from its params), except
    the state that ``cuda_graph(..., warmup_trains=True)`` consumed: its warm-up wrote part
    of it in place (params, moments) and left the rest (counters) behind, so passing it
    continues from the graph's state, as a training loop that keeps its ``state`` variable
    expects. ``metrics`` are the graph's output tensors, overwritten by the next call:
    clone what you keep.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
        state: the graph's state (what the last call returned).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, state: Any, batch: tuple[Any, ...],
                 out: Any, metrics: dict[str, Any], consumed: Any = None) -> None:
        self.graph = graph
        self.state = state
        self._consumed = _tensor_refs(consumed)
        self._batch = batch
        self._metrics = metrics
        s_leaves, s_spec = optree.tree_flatten(state)
        o_leaves, o_spec = optree.tree_flatten(out)
        if s_spec != o_spec:
            raise RuntimeError("fmp.cuda_graph: the step returned a state of another "
                               f"structure than it was given ({o_spec} vs {s_spec}); a "
                               "captured step must map a state to one of the same shape")
        moved = [(s, o) for s, o in zip(s_leaves, o_leaves, strict=True)
                 if isinstance(s, torch.Tensor) and s is not o]
        # grouped once: every replay copies the same pairs
        self._copies = copy_groups([s for s, _ in moved], [o for _, o in moved])

    def _load(self, state: Any) -> None:
        """Copy another state into the graph's; its compute copy is rebuilt from the params."""
        mine = self.state
        if isinstance(mine, TrainState) and isinstance(state, TrainState):
            state = state._replace(compute_params=mine.compute_params)
        _copy_into("state", mine, state)
        if isinstance(mine, TrainState) and mine.compute_params is not None:
            donate_into(mine.compute_params, mine.params)  # converts to the copy's dtypes

    def __call__(self, state: Any, *batch: Any) -> tuple[Any, dict[str, Any]]:
        """Run the captured step on ``batch``; returns ``(self.state, metrics)``.

        Raises:
            ValueError: the batch (or a state passed in) differs from the captured one
                in structure, dtype or shape.
        """
        if state is not self.state and not _is_state(self._consumed, state):
            self._load(state)
        _copy_into("batch", self._batch, batch)
        self.graph.replay()
        for dst, src in self._copies:  # what the step did not write in place (all of it
            torch._foreach_copy_(dst, src)  # without donation), a dtype group at a time
        return self.state, self._metrics


def cuda_graph(step: Callable[..., Any], state: Any, *batch: Any, warmup: int = 3,
               warmup_trains: bool = False) -> GraphedStep:
    """Capture a train step in one CUDA graph, to replay it without launch overhead.

    ``step`` is any ``step(state, *batch) -> (state, metrics)`` that does not sync the
    host: a :class:`fmp.TrainStep`, a :class:`fmp.CompiledStep` or any other function,
    typically ``fmp.compile(fmp.train_step(..., donate=True))`` (on the GPT-2 step
    on an H200 this is the fastest form: benchmarks/RESULTS.md). The warm-up steps that
    capture needs (lazy initialisation, compilation) run on a side stream, on a copy of
    ``state`` (so they do not train it), or with ``warmup_trains=True`` on ``state``
    itself, as torch's CUDA-graph recipe does (they train it on the example batch and
    save the memory of the copy). The capture itself runs nothing. With
    ``warmup_trains=True``, ``state`` is consumed: passing it to the graph again continues
    from the trained state (nothing of it is loaded).

    The graph is captured with ``batch``'s shapes and dtypes; call it with batches of the
    same (non-tensor values, e.g. Python numbers, are fixed at capture). With a donated
    step the params and optimizer state are updated in place and only the small counters
    are copied after each replay; without donation every state tensor is copied back.
    Skips, the loss scale and the compute copy behave as in the step itself.

    Args:
        step: the train step.
        state: the state to train (its tensors become the graph's inputs: it is consumed,
            as by a donated step).
        *batch: an example batch; its tensors are copied into the graph's inputs.
        warmup: steps to run before capture (at least 1; fmp.compile needs 2 or more to
            finish compiling).
        warmup_trains: run the warm-up steps on ``state`` instead of a copy.

    Returns:
        A :class:`GraphedStep`: ``state, metrics = graphed(state, *batch)``.

    Raises:
        ValueError: a tensor of ``state`` or ``batch`` is not on a CUDA device, or
            ``warmup`` < 1.

    Example:
        >>> graphed = fmp.cuda_graph(fmp.compile(step), state, x, y)  # doctest: +SKIP
        >>> for x, y in loader:  # doctest: +SKIP
        ...     state, metrics = graphed(state, x, y)
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    _check_cuda("state", state)
    _check_cuda("batch", batch)
    phases = step.step if isinstance(step, CompiledStep) else step
    if not isinstance(phases, TrainStep):
        phases = None  # a plain callable: no phases to prepare the state with
    consumed = state if warmup_trains else None  # what the caller may pass again
    if phases is not None:  # the copy the graph reads: current now, so no cast is captured
        state = phases.prepare(phases.private(state))  # and nothing of the module's written
    static_batch = _clone(batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    def prepared() -> contextlib.AbstractContextManager[None]:
        # the state was made private above: a step traced whole may write into it
        return prepared_on_host() if phases is not None else contextlib.nullcontext()

    with torch.cuda.stream(side), prepared():
        warm = state if warmup_trains else _clone(state)
        for _ in range(warmup):
            warm, _ = step(warm, *static_batch)
        if warmup_trains:
            state = warm
        del warm
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), prepared():
        out, metrics = step(state, *static_batch)
    if isinstance(state, TrainState):  # the capture consumed it; each replay makes it whole
        release(state.step)
    if isinstance(state, TrainState) and isinstance(out, TrainState) and (
            (state.compute_params is None) != (out.compute_params is None)):
        # the step keeps no copy (a whole-graph trace), or made one inside the capture
        # (which then recasts on every replay): the graph's state holds what it returns
        state = state._replace(compute_params=out.compute_params)
    return GraphedStep(graph, state, static_batch, out, metrics, consumed=consumed)
