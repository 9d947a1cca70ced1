"""Turn an ``nn.Module`` into a pure function of a params dict (torch.func.functional_call)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call

from fmp import _model, _norm_cast
from fmp._batched import clone_all
from fmp._eager import eager_kernels_ok
from fmp._reparam import Slots
from fmp.policy import NORM_LAYERS

__all__ = ["functional"]

ApplyFn = Callable[..., Any]


def _copies(buffers: dict[str, Any]) -> dict[str, Any]:
    """The buffers' copies the forward may update (what ``return_buffers=True`` returns):
    in eager mode a multi-tensor clone per dtype (``clone_all``), not a clone per buffer."""
    if not eager_kernels_ok():
        return {n: (b.clone() if isinstance(b, torch.Tensor) else b) for n, b in buffers.items()}
    plain = [n for n, b in buffers.items() if type(b) is torch.Tensor and not b.requires_grad]
    out = dict(zip(plain, clone_all([buffers[n] for n in plain]), strict=True))
    return {n: out[n] if n in out else (b.clone() if isinstance(b, torch.Tensor) else b)
            for n, b in buffers.items()}


def _updating_buffers(named_modules: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """Modules whose forward updates running statistics in place in the current mode."""
    out = []
    for name, m in named_modules:
        if (m.training and getattr(m, "track_running_stats", False)
                and getattr(m, "running_mean", None) is not None):
            out.append(f"{name}.running_mean" if name else "running_mean")
    return out


def functional(model: torch.nn.Module) -> tuple[ApplyFn, dict[str, torch.Tensor],
                                                 dict[str, torch.Tensor]]:
    """Split a module into a pure apply function, its trainable params and its buffers.

    ``apply_fn(params, *args, buffers=None, return_buffers=False, **kwargs)`` runs the
    module's forward with the given params (through ``torch.func.functional_call``, tied
    weights kept tied).

    Frozen params (``requires_grad=False``, the usual way to fine-tune part of a model) are
    not in ``params``: a step built on it neither updates them nor gives them optimizer
    state, and computes no grads for them. ``apply_fn`` supplies them itself (the module's
    own tensors, ``apply_fn.frozen``); inside :func:`fmp.train_step` or
    :func:`fmp.value_and_grad` it casts them to the compute dtype the step's policy gives
    them (norm layers kept in float32 as :func:`fmp.module_policies` does), elsewhere they
    are used as stored. A name given in ``params`` wins over the frozen one. Which params
    are frozen is read once, here: call :func:`functional` again after changing
    ``requires_grad``.

    Buffers:

    - ``buffers=None`` uses the module's own buffers, exactly as calling the module would
      (a BatchNorm in training mode updates them in place). Inside
      :func:`fmp.train_step` that is refused for running statistics (a skipped step could
      not undo it): train such models with ``has_state=True``;
    - ``buffers=b`` uses ``b``; with ``return_buffers=True`` the call works on copies and
      returns ``(out, new_buffers)``, leaving ``b`` (and the module) untouched. This is the
      pure form the train step uses for model state.

    Args:
        model: any ``nn.Module``. Its train/eval mode is used as it is at call time.

    Returns:
        ``(apply_fn, params, buffers)``: ``params`` (the trainable params) and ``buffers``
        are dicts keyed by the module's names, holding detached tensors that share storage
        with the module's (no copy is made). By default the step never writes into them:
        a step with ``donate=True`` copies them on first use, so the module keeps its own
        values (load trained ones back with ``model.load_state_dict(state.params,
        strict=False)``). ``fmp.TrainState.create(params, ..., donate=True)`` hands them
        to the step instead: no copy is held and the module follows every update in
        place. ``apply_fn.frozen`` holds the frozen params likewise.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: (when called inside a train step) a forward would update the running
            statistics of the module's own buffers, or of ``buffers`` without
            ``return_buffers=True``.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        >>> net[0].requires_grad_(False)  # doctest: +ELLIPSIS
        Linear(...)
        >>> apply_fn, params, buffers = fmp.functional(net)
        >>> list(params), list(apply_fn.frozen)
        (['1.weight', '1.bias'], ['0.weight', '0.bias'])
        >>> apply_fn(params, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fmp.functional needs a torch.nn.Module, got {type(model).__name__}")
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    norm_names = {f"{m}.{n}" if m else n for m, mod in model.named_modules()
                  if isinstance(mod, NORM_LAYERS) for n, _ in mod.named_parameters(recurse=False)}
    _model.register(model)
    _norm_cast.install(model)  # float32 norms take 16-bit inputs on CUDA too
    cache: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
    slots = Slots(model)

    def frozen_for_step(given: dict[str, Any]) -> dict[str, Any]:
        """The frozen params ``given`` lacks, in the running step's compute dtypes."""
        act = _model.ACTIVE
        missing = {n: t for n, t in frozen.items() if n not in given}
        if act.policy is None or not missing:
            return missing
        want = tuple(act.compute_dtype(n, n in norm_names) for n in missing)
        eager = eager_kernels_ok()
        key = (want, tuple(missing), tuple(t._version for t in missing.values())) if eager else ()
        if eager and key in cache:
            return cache[key]
        with torch.no_grad():
            out = {n: (t.to(d) if d is not None and t.is_floating_point() and t.dtype != d
                       else t) for (n, t), d in zip(missing.items(), want, strict=True)}
        if eager:
            cache.clear()
            cache[key] = out
        return out

    def apply_fn(params: dict[str, Any], *args: Any, buffers: dict[str, Any] | None = None,
                 return_buffers: bool = False, **kwargs: Any) -> Any:
        slots.ensure()
        if _model.ACTIVE.skip_safe and not return_buffers:
            updating = _updating_buffers(slots.named_modules())
            if updating:
                whose = "the module's own buffers" if buffers is None else "the buffers given"
                raise ValueError(
                    f"fmp.train_step: this forward updates running statistics in place "
                    f"({', '.join(updating[:3])}{' ...' if len(updating) > 3 else ''}) in "
                    f"{whose}; a skipped step could not undo that. Train with "
                    "train_step(..., has_state=True), TrainState.create(..., model_state="
                    "buffers) and apply_fn(p, *batch, buffers=model_state, "
                    "return_buffers=True) in loss_fn, or put the module in eval mode")
        if buffers is None:
            buffers = slots.named_buffers()
        if return_buffers:
            buffers = _copies(buffers)
        if frozen:
            params = {**frozen_for_step(params), **params}
        _norm_cast.depth[0] += 1
        try:
            # names resolved once (fmp/_reparam.py), eager and under torch.compile
            if torch.compiler.is_compiling() or eager_kernels_ok():
                out = slots.call(params, buffers, args, kwargs, write_back=return_buffers,
                                 checked=True)
            else:
                out = functional_call(model, (params, buffers), args, kwargs,
                                      tie_weights=True, strict=False)
        finally:
            _norm_cast.depth[0] -= 1
        return (out, buffers) if return_buffers else out

    apply_fn.__doc__ = f"Pure forward of {type(model).__name__} (see fmp.functional)."
    apply_fn.frozen = frozen  # type: ignore[attr-defined]
    return apply_fn, params, buffers
