"""The demo's outputs: a text table, a figure of the curves, and a JSON file."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fmp.demo.run import DemoConfig, RunResult

__all__ = ["format_table", "save_curves", "save_json"]

_COLUMNS = ("policy", "engine", "test acc %", "vs fp32", "final loss", "steps/s", "skipped",
            "loss scale", "peak MiB")


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _reference(results: Sequence[RunResult]) -> float | None:
    for r in results:
        if r.policy.lower() in ("fp32", "o0") and r.test_accuracy is not None:
            return r.test_accuracy
    return None


def format_table(results: Sequence[RunResult]) -> str:
    """The results as an aligned text table, one row per policy.

    ``vs fp32`` is the accuracy difference to the fp32 run in points (when there is one);
    an unavailable policy gets a row that says why.

    Args:
        results: the runs, in order.

    Returns:
        The table, lines joined by newlines (no trailing newline).

    Example:
        >>> print(format_table([RunResult("fp32", "fmp.train_step", test_accuracy=97.5)]))
        ... # doctest: +SKIP
    """
    ref = _reference(results)
    rows = [list(_COLUMNS)]
    notes = []
    for r in results:
        if not r.available:
            rows.append([r.policy, r.engine, "n/a"] + ["-"] * (len(_COLUMNS) - 3))
            notes.append(f"{r.policy}: unavailable: {r.reason}")
            continue
        delta = (None if ref is None or r.test_accuracy is None
                 else r.test_accuracy - ref)
        rows.append([
            r.policy, r.engine, _fmt(r.test_accuracy, ".2f"), _fmt(delta, "+.2f"),
            _fmt(r.final_loss, ".4f"), _fmt(r.steps_per_s, ".1f"), _fmt(r.skipped_steps, "d"),
            _fmt(r.final_loss_scale, ".0f"), _fmt(r.peak_memory_mb, ".1f"),
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < 2 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + notes)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """A trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def save_curves(results: Sequence[RunResult], path: str | Path) -> Path:
    """Draw the loss curves and the loss-scale trajectories of the runs to a PNG.

    Three panels: the training loss of every policy per step (faint) and its moving
    average (bold), log scale; the moving average of each policy's loss minus fp32's
    (every policy sees the same batches, so this is what the precision changes); the
    loss scale after every step, log2 scale, with a marker at each back-off, for the
    policies that scale their loss. Uses matplotlib's object API with the Agg canvas, so
    the global pyplot backend is neither needed nor changed.

    Args:
        results: the runs (unavailable ones are left out).
        path: the PNG to write (its folder must exist).

    Returns:
        The path written.
    """
    from matplotlib.figure import Figure

    runs = [r for r in results if r.available and r.losses]
    fig = Figure(figsize=(15, 4.6), layout="constrained")
    ax_loss, ax_diff, ax_scale = fig.subplots(1, 3)
    window = max(1, min(20, max((len(r.losses) for r in runs), default=1) // 8))
    ref = next((r for r in runs if r.policy.lower() in ("fp32", "o0")), None)
    ref_smooth = _smooth(ref.losses, window) if ref else None
    unscaled = []
    for i, r in enumerate(runs):
        color, label = f"C{i}", f"{r.policy} ({r.engine})"
        steps = list(range(1, len(r.losses) + 1))
        smooth = _smooth(r.losses, window)
        ax_loss.plot(steps, r.losses, color=color, alpha=0.15, linewidth=0.8)
        ax_loss.plot(steps, smooth, color=color, linewidth=1.6, label=label)
        if ref_smooth is not None and r is not ref and len(r.losses) == len(ref.losses):
            ax_diff.plot(steps, [a - b for a, b in zip(smooth, ref_smooth, strict=True)],
                         color=color, linewidth=1.4, label=label)
        if r.loss_scales and any(v != 1.0 for v in r.loss_scales):
            ax_scale.step(steps, r.loss_scales, where="post", color=color, linewidth=1.6,
                          label=f"{r.policy}: {r.skipped_steps} skipped")
            backoffs = [k for k in range(1, len(r.loss_scales))
                        if r.loss_scales[k] < r.loss_scales[k - 1]]
            if backoffs:
                ax_scale.plot([k + 1 for k in backoffs], [r.loss_scales[k] for k in backoffs],
                              "v", color=color, markersize=5)
        else:
            unscaled.append(r.policy)
    ax_loss.set(title=f"Training loss (bold: {window}-step moving average)", xlabel="step",
                ylabel="cross-entropy loss")
    if any(v > 0 for r in runs for v in r.losses):
        ax_loss.set_yscale("log")
    ax_diff.axhline(0.0, color="0.3", linewidth=0.8)
    ax_diff.set(title="Loss minus fp32's loss (same batches, moving average)",
                xlabel="step", ylabel="loss difference")
    ax_scale.set(title="Dynamic loss scale after each step (▼: back-off)", xlabel="step",
                 ylabel="loss scale")
    if ax_scale.lines:
        ax_scale.set_yscale("log", base=2)
    if unscaled:
        ax_scale.text(0.02, 0.03, "no loss scaling: " + ", ".join(unscaled),
                      transform=ax_scale.transAxes, fontsize=9, color="0.35")
    for ax in (ax_loss, ax_diff, ax_scale):
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def _clean(x: Any) -> Any:
    """NaN and inf as None, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


def save_json(results: Sequence[RunResult], config: DemoConfig, path: str | Path,
              extra: dict[str, Any] | None = None) -> Path:
    """Write the configuration and every run's numbers and curves as JSON.

    Args:
        results: the runs.
        config: the configuration they ran with.
        path: the file to write.
        extra: more top-level entries (e.g. the torch version, the wall time).

    Returns:
        The path written. The file holds ``{"config": {...}, "results": [{...}, ...],
        **extra}``; each result has the fields of :class:`fmp.demo.run.RunResult`
        (non-finite numbers are written as null).
    """
    doc = {"config": dataclasses.asdict(config),
           "results": [dataclasses.asdict(r) for r in results], **(extra or {})}
    path = Path(path)
    path.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    return path
