"""Training one policy of the demo: through ``fmp.train_step`` or the Apex adapter."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fmp
from fmp.demo.data import DigitsSplit, batch_indices
from fmp.demo.model import make_model

__all__ = ["APEX_LEVELS", "DemoConfig", "RunResult", "apex_available", "cosine_lr",
           "run_policy"]

#: Policy names run through the Apex adapter (``adapters.apex``) instead of fmp.train_step.
APEX_LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
_LOSS_WINDOW = 20


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The knobs of a demo run (the command line's flags).

    Attributes:
        policies: names to run, fmp policy names or Apex opt levels (``O1``, ``O2``...).
        steps: optimizer steps per policy.
        batch_size: images per step.
        lr: peak learning rate of AdamW (cosine decay to 0 over ``steps``).
        weight_decay: AdamW's decoupled weight decay.
        seed: seeds the split, the initial weights and the batch order.
        device: ``"cpu"`` or ``"cuda"``.
        compile: compile fmp's train step with :func:`fmp.compile` (two ``fullgraph=True`` graphs).
        progress: show a tqdm progress bar.
    """

    policies: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed")
    steps: int = 150
    batch_size: int = 64
    lr: float = 2e-2
    weight_decay: float = 1e-4
    seed: int = 0
    device: str = "cpu"
    compile: bool = False
    progress: bool = True


@dataclasses.dataclass
class RunResult:
    """What one policy's run produced (one row of the table, one curve of the plot).

    Attributes:
        policy: the name as given.
        engine: ``"fmp.train_step"`` or ``"adapters.apex"``.
        available: False when the policy could not run (``reason`` says why).
        reason: why it did not run, or None.
        test_accuracy: accuracy on the test split, in percent.
        final_loss: mean training loss over the last 20 steps.
        steps_per_s: training speed, the first (warm-up/compile) step excluded.
        skipped_steps: steps whose update was skipped (non-finite grads).
        final_loss_scale: the loss scale after the last step (1.0 without scaling).
        peak_memory_mb: peak CUDA memory allocated during the run (None on the CPU).
        wall_s: seconds the run took, evaluation included.
        losses: the training loss of every step.
        loss_scales: the loss scale after every step.
    """

    policy: str
    engine: str
    available: bool = True
    reason: str | None = None
    test_accuracy: float | None = None
    final_loss: float | None = None
    steps_per_s: float | None = None
    skipped_steps: int | None = None
    final_loss_scale: float | None = None
    peak_memory_mb: float | None = None
    wall_s: float | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    loss_scales: list[float] = dataclasses.field(default_factory=list)


def cosine_lr(lr: float, steps: int) -> Callable[[Any], Any]:
    """A cosine decay from ``lr`` to 0 over ``steps`` updates.

    Args:
        lr: the initial rate.
        steps: the number of updates the decay spans (later ones get 0).

    Returns:
        ``schedule(count)``: a 0-d tensor for a tensor ``count`` (no host sync, as
        :mod:`fmp.optim` wants), a float for an int (as ``torch.optim.lr_scheduler``
        wants).

    Example:
        >>> cosine_lr(1.0, 10)(5)
        0.5
    """
    span = max(steps, 1)

    def schedule(count: Any) -> Any:
        if isinstance(count, torch.Tensor):
            frac = (count.to(torch.float32) / span).clamp(max=1.0)
            return 0.5 * lr * (1.0 + torch.cos(math.pi * frac))
        return 0.5 * lr * (1.0 + math.cos(math.pi * min(count / span, 1.0)))

    return schedule


def apex_available() -> str | None:
    """None when ``adapters.apex`` imports and provides ``amp.initialize``, else why not.

    Returns:
        None, or a short reason (for the table).
    """
    try:
        from adapters import apex  # here, not at the top: a broken adapter is reported
    except Exception as e:  # any import failure means "not usable"
        return f"adapters.apex not importable ({type(e).__name__})"
    if not callable(getattr(getattr(apex, "amp", None), "initialize", None)):
        return "adapters.apex has no amp.initialize yet"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(cfg: DemoConfig, name: str) -> Any:
    from tqdm.auto import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, CI), unless asked off.
    return tqdm(total=cfg.steps, desc=f"{name:>11}", unit="step",
                disable=None if cfg.progress else True, leave=True, dynamic_ncols=True)


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * (logits.argmax(-1) == y).float().mean().item()


def _finish(result: RunResult, losses: list[torch.Tensor], scales: list[torch.Tensor],
            skipped: torch.Tensor | int, elapsed: float, timed_steps: int) -> None:
    result.losses = torch.stack(losses).tolist() if losses else []
    result.loss_scales = torch.stack(scales).tolist() if scales else []
    tail = result.losses[-_LOSS_WINDOW:]
    result.final_loss = sum(tail) / len(tail) if tail else None
    result.final_loss_scale = result.loss_scales[-1] if result.loss_scales else None
    result.skipped_steps = int(skipped)
    result.steps_per_s = timed_steps / elapsed if timed_steps and elapsed > 0 else None


def _run_functional(name: str, data: DigitsSplit, cfg: DemoConfig,
                    device: torch.device) -> RunResult:
    """Train with ``fmp.train_step`` under the fmp policy ``name``."""
    result = RunResult(policy=name, engine="fmp.train_step")
    base, _, bf16_update = name.partition("+")  # "bf16-true+kahan": no float32 masters
    policy = fmp.get_policy(base)
    model = make_model(cfg.seed, device)
    apply_fn, params, _ = fmp.functional(model)
    params = policy.cast_to_param(params)

    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(apply_fn(p, x).float(), y)

    opt = fmp.optim.adamw(cosine_lr(cfg.lr, cfg.steps), weight_decay=cfg.weight_decay,
                          state_dtype="bf16" if bf16_update else "f32",
                          bf16_update=bf16_update or None)
    needs_scaling = policy.compute_dtype == torch.float16
    scale = fmp.DynamicLossScale.create(device=device) if needs_scaling else None
    step = fmp.train_step(loss_fn, opt, policy)
    if cfg.compile:
        step = fmp.compile(step)  # two fullgraph graphs: loss (fwd/bwd), update
    state = fmp.TrainState.create(params, opt, scale)

    idx = batch_indices(len(data.y_train), cfg.batch_size, cfg.steps, cfg.seed).to(device)
    losses: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    t_first = t0 = time.perf_counter()
    with _progress(cfg, name) as bar:
        for i in range(cfg.steps):
            b = idx[i]
            state, m = step(state, data.x_train[b], data.y_train[b])
            losses.append(m["loss"])
            scales.append(m["loss_scale"].to(device))
            if i == 0:
                _sync(device)
                t0 = time.perf_counter()
            if (i + 1) % 25 == 0 or i + 1 == cfg.steps:
                bar.set_postfix(loss=f"{float(m['loss']):.3f}", refresh=False)
            bar.update(1)
    _sync(device)
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        x_test = policy.cast_to_compute(data.x_test)
        logits = apply_fn(policy.cast_to_compute(state.params), x_test)
    result.test_accuracy = _accuracy(logits, data.y_test)
    skipped = state.skipped_total if state.skipped_total is not None else 0
    _finish(result, losses, scales, skipped, elapsed, cfg.steps - 1)
    result.wall_s = time.perf_counter() - t_first
    return result


def _run_apex(level: str, data: DigitsSplit, cfg: DemoConfig, device: torch.device) -> RunResult:
    """Train an Apex-style legacy loop: torch.optim.AdamW + ``amp.initialize``."""
    from fmp.demo import legacy

    result = RunResult(policy=level, engine="adapters.apex")
    t_first = time.perf_counter()
    out = legacy.train(level, data, cfg, device, _progress(cfg, level))
    result.test_accuracy = out["accuracy"]
    _finish(result, out["losses"], out["scales"], out["skipped"], out["elapsed"],
            cfg.steps - 1)
    result.wall_s = time.perf_counter() - t_first
    return result


def run_policy(name: str, data: DigitsSplit, cfg: DemoConfig) -> RunResult:
    """Train the demo's CNN under one policy and evaluate it on the test split.

    Apex opt levels (``O0``..``O5``, any case) run the legacy loop through
    ``adapters.apex``; when the adapter is not usable the result says so
    (``available=False``) instead of failing. Other names are fmp policies run through
    :func:`fmp.train_step` (a :class:`fmp.DynamicLossScale` when computing in float16).

    Args:
        name: the policy name.
        data: the split (on ``cfg.device``).
        cfg: the run's configuration.

    Returns:
        A :class:`RunResult`.

    Raises:
        ValueError: ``name`` is neither an Apex opt level nor an fmp policy.

    Example:
        >>> from fmp.demo.data import load_digits_split
        >>> r = run_policy("fp32", load_digits_split(), DemoConfig(steps=5, progress=False))
        >>> r.skipped_steps, len(r.losses)
        (0, 5)
    """
    device = torch.device(cfg.device)
    peak = device.type == "cuda"
    if peak:
        torch.cuda.reset_peak_memory_stats(device)
    level = name.upper()
    if level in APEX_LEVELS:
        why = apex_available()
        if why is not None:
            return RunResult(policy=name, engine="adapters.apex", available=False, reason=why)
        result = _run_apex(level, data, cfg, device)
    else:
        result = _run_functional(name, data, cfg, device)
    if peak:
        result.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
    return result
