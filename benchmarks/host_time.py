"""Host time of one eager train step: how long the Python call takes to queue its work.

    python benchmarks/host_time.py                       # CUDA: GPT-2 small + ResNet-50
    python benchmarks/host_time.py --tree out/before     # the same steps of another checkout
    python benchmarks/host_time.py --tiny --device cpu   # smoke test

Per variant of ``benchmarks/train_step.py`` (built by its ``build``): the device is synced,
the step called, the time until the call returns taken (the host's work: tree walks, checks,
kernel launches), then synced again, so the launch queue never fills and the host time is
not hidden behind the GPU's. Median over the steps, with the step's device time (CUDA
events) beside it. ``--tree DIR`` imports fmp, the adapters and the benchmark's builders
from another checkout (e.g. ``git archive <commit> | tar -x -C out/before``), so the
same machine measures a change before and after in one lease.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--device", default=None)
    ap.add_argument("--gpt-variants", default="amp_fp16_eager,fmp_fp16_eager_donate,"
                    "fmp_bf16_eager,apex_o1,apex_o2")
    ap.add_argument("--resnet-variants", default="amp_fp16_eager,fmp_fp16_eager_donate,"
                    "apex_o1,apex_o2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    sys.path[:0] = [str(tree), str(tree / "benchmarks")]
    import torch
    import train_step as ts

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    res: dict[str, dict[str, dict[str, float]]] = {}
    for model_name, variants in (("gpt", args.gpt_variants), ("resnet", args.resnet_variants)):
        for v in filter(None, variants.split(",")):
            ts._fresh(device)
            try:
                step, _ = ts.build(model_name, v, device, args.tiny)
                host, dev, loss = [], [], None
                for i in range(args.warmup + args.steps):
                    ts._sync(device)
                    if device == "cuda":
                        a = torch.cuda.Event(enable_timing=True)
                        b = torch.cuda.Event(enable_timing=True)
                        a.record()
                    t0 = time.perf_counter()
                    loss = step()
                    t1 = time.perf_counter()
                    if device == "cuda":
                        b.record()
                    ts._sync(device)
                    if i >= args.warmup:
                        host.append((t1 - t0) * 1e3)
                        if device == "cuda":
                            dev.append(a.elapsed_time(b))
                r = {"host_ms": statistics.median(host), "loss": float(loss)}
                if dev:
                    r["device_ms"] = statistics.median(dev)
            except Exception as e:  # a variant that cannot run is reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                if hasattr(ts, "_drop_apex_casts"):  # O1's casts act process-wide
                    ts._drop_apex_casts()
            res.setdefault(model_name, {})[v] = r
            print(model_name, v, json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"tree": str(tree), "results": res}, indent=1))


if __name__ == "__main__":
    main()
