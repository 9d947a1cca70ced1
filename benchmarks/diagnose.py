"""Where a variant's time and memory go: live blocks at its memory peak, GPU time by kernel.

Untimed diagnostics for the variants of ``train_step.py`` (CUDA). For each variant it
builds and runs the step with the allocator's history on (``memory_peak.live_at_peak``),
then profiles a few steps with ``torch.profiler`` and sums GPU time by kernel. Write a
prediction before reading its output (the device tool's METHOD.md).

    python benchmarks/diagnose.py --variants fmp_fp16_compiled,amp_fp16_compiled_loss
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_peak import live_at_peak
from train_step import _fresh, build


def kernel_times(step, steps: int = 3, top: int = 25) -> dict[str, Any]:
    """GPU time per step by kernel name over ``steps`` profiled steps (after one warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            b = by[e.name[:90]]
            b[0] += e.device_time / 1e3 / steps
            b[1] += 1 / steps
    total = sum(v[0] for v in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])
    return {"gpu_ms_per_step": total, "kernels_per_step": sum(v[1] for v in by.values()),
            "top": [{"ms": v[0], "n": v[1], "name": k} for k, v in rows[:top]]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=["gpt", "resnet"])
    ap.add_argument("--variants", required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("diagnose.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict[str, Any] = {}
    for v in args.variants.split(","):
        _fresh("cuda")
        r: dict[str, Any] = {}
        try:
            with live_at_peak() as mem:
                step, _ = build(args.model, v, "cuda", False)
                for _ in range(args.warmup):
                    step()
            r["memory"] = mem
            r["kernels"] = kernel_times(step)
        except Exception as e:  # report and go on to the next variant
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res[v] = r
        print(f"\n== {v}: " + (r["error"] if "error" in r else
              f"peak {mem['peak_gb']:.2f} GB, GPU {r['kernels']['gpu_ms_per_step']:.2f} ms "
              f"in {r['kernels']['kernels_per_step']:.0f} kernels per step"), flush=True)
        for s in r.get("memory", {}).get("sites", []):
            print(f"  {s['gb']:7.3f} GB {s['n']:4d}x  {s['where']}")
        for k in r.get("kernels", {}).get("top", []):
            print(f"  {k['ms']:7.3f} ms {k['n']:5.0f}x  {k['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
