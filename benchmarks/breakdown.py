"""Where a train step's GPU time goes: profiler kernel time by kind, plus idle gaps.

    python benchmarks/breakdown.py --variants gpt:fmp_fp16_graph,gpt:amp_graph_fp16 --out b.json
    python benchmarks/breakdown.py --tiny --device cpu --variants gpt:amp_fp16_eager  # smoke

Per variant (each in its own process with an empty inductor cache when there is more than
one, as ``train_step.py --isolate`` does): the step time without the profiler (median of
CUDA events), then ``torch.profiler`` over a few steps; every kernel's device time goes into
one bucket by its name (matmuls, attention, elementwise/norms, cross-entropy, optimizer
update, casts, memcpy/memset, other) and ``idle`` is the step time minus the union of the
kernels' busy intervals. On CPU the buckets hold the CPU ops' self time instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step

BUCKETS = ("matmuls", "attention", "elementwise_norms", "cross_entropy", "optimizer_update",
           "casts", "memcpy_memset", "other")
_ATTN = ("flash", "fmha", "sdpa", "attention", "attn")
_MM = ("gemm", "cutlass", "nvjet", "cublas", "xmma", "cudnn", "sm90_", "sm80_", "implicit",
       "wgrad", "dgrad", "fprop", "conv2d", "convolution", "matmul")
_MM_ATEN = {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution",
            "mkldnn_convolution", "linear", "cudnn_convolution"}
_CE = ("log_softmax", "nll_loss", "cross_entropy", "nll")
_OPT = ("adam", "sgd", "multi_tensor", "foreach", "amp_update_scale", "non_finite",
        "momentum", "lerp", "addcmul")
_CAST_TOKENS = {"to", "copy", "convert", "element", "type", "clone", "view", "contiguous"}
_CAST = ("direct_copy", "copyfunctor", "copy_kernel", "to_copy", "_copy", "copy_", "convert")
_NORM_ELEM = ("layer_norm", "batch_norm", "norm", "elementwise", "vectorized", "reduce",
              "triton_", "gelu", "tanh", "add", "mul", "fill", "welford", "embedding",
              "index", "scatter", "gather", "sum", "softmax", "div", "sqrt", "where")


def bucket_of(name: str) -> str:
    """The bucket of one kernel (or, on CPU, aten op) name.

    Args:
        name: a CUDA kernel name as the profiler reports it, or an ``aten::`` op name.

    Returns:
        One of :data:`BUCKETS`.

    Example:
        >>> bucket_of("sm90_xmma_gemm_f16f16_f32")
        'matmuls'
    """
    n = name.lower()
    if n.startswith(("memcpy", "memset")):
        return "memcpy_memset"
    if any(k in n for k in _ATTN):
        return "attention"
    if n.startswith("aten::"):
        base = n[6:].rstrip("_")
        if base in _MM_ATEN:
            return "matmuls"
    elif any(k in n for k in _MM):
        return "matmuls"
    if any(k in n for k in _CE):
        return "cross_entropy"
    if n.startswith("triton_"):
        # inductor names a kernel by its ops: triton_<kind>_fused_<op>_<op>..._<n>
        ops = n.split("fused_", 1)[1] if "fused_" in n else ""
        tokens = {t for t in re.split(r"[^a-z0-9]+", ops) if t and not t.isdigit()}
        if tokens and tokens <= _CAST_TOKENS:
            return "casts"
        if tokens & {"lerp", "addcmul", "sqrt", "adam", "foreach"}:
            return "optimizer_update"
        return "elementwise_norms"
    if "copyfunctor" in n and "multi_tensor" in n:
        return "casts"
    if any(k in n for k in _OPT):
        return "optimizer_update"
    if any(k in n for k in _CAST):
        return "casts"
    if any(k in n for k in _NORM_ELEM):
        return "elementwise_norms"
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(kernels: list[tuple[str, float, float]], steps: int,
              step_ms: float | None) -> dict[str, Any]:
    """Bucket kernel times per step; idle = step time minus the kernels' busy union.

    Args:
        kernels: ``(name, start_us, end_us)`` of every kernel in the profiled steps.
        steps: how many steps were profiled.
        step_ms: the step time measured without the profiler (None: no idle figure).

    Returns:
        ``{"ms": {bucket: ms per step}, "kernels_per_step", "busy_ms", "idle_ms",
        "step_ms", "top": [...], "most_launched": [...]}``: ``top`` the 30 kernels of most
        time, ``most_launched`` the 30 launched most often (launches per step each), where
        a step's extra small kernels, and so its idle gaps, show.
    """
    ms = dict.fromkeys(BUCKETS, 0.0)
    per_name: dict[str, float] = {}
    launches: dict[str, int] = {}
    for name, a, b in kernels:
        d = (b - a) / 1e3 / steps
        ms[bucket_of(name)] += d
        per_name[name] = per_name.get(name, 0.0) + d
        launches[name] = launches.get(name, 0) + 1
    busy = _union_us([(a, b) for _, a, b in kernels]) / 1e3 / steps
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:30]
    return {"ms": ms, "kernels_per_step": len(kernels) / steps, "busy_ms": busy,
            "step_ms": step_ms, "idle_ms": None if step_ms is None else max(step_ms - busy, 0.0),
            "top": [{"name": k[:160], "bucket": bucket_of(k), "ms": v} for k, v in top],
            "most_launched": [{"name": k[:160], "per_step": n / steps, "ms": per_name[k]}
                              for k, n in sorted(launches.items(), key=lambda kv: -kv[1])[:30]]}


def profile_variant(model: str, variant: str, device: str, tiny: bool, steps: int,
                    warmup: int) -> dict[str, Any]:
    """Build the variant with train_step's builders, time it, then profile ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        # start CUPTI before any graph is captured: kernels replayed from a graph captured
        # before the tracer first ran may be reported as one launch, not kernel by kernel
        with profile(activities=acts):
            torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize()
    step, info = train_step.build(model, variant, device, tiny)
    ms, loss = train_step.time_steps(step, device, warmup, 10)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        train_step._sync(device)
    kernels = []
    cpu_self: dict[str, float] = {}
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if device == "cuda" and dt == torch.autograd.DeviceType.CUDA:
            kernels.append((e.name, e.time_range.start, e.time_range.end))
        elif device != "cuda" and e.name.startswith("aten::"):
            cpu_self[e.name] = cpu_self.get(e.name, 0.0) + e.self_cpu_time_total
    if device != "cuda":  # self times laid end to end: no overlap, no idle figure
        t, kernels = 0.0, []
        for name, us in cpu_self.items():
            kernels.append((name, t, t + us))
            t += us
    out = summarize(kernels, steps, statistics.median(ms) if device == "cuda" else None)
    out.update(model=model, variant=variant, loss=loss, device=device,
               graphed=bool(info.get("graphed")),
               what="CUDA kernels" if device == "cuda" else "CPU aten ops, self time")
    if device == "cuda" and out["kernels_per_step"] < 50:
        # a GPT-2 step runs hundreds of kernels: fewer means the tracer missed the graph's
        out["warning"] = (f"only {out['kernels_per_step']:.0f} kernels per step seen: the "
                          "profiler did not see the kernels inside the CUDA graph replay")
    return out


def _isolated(spec: str, args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fmp-breakdown-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        out = os.path.join(tmp, "one.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--variants", spec, "--out", out,
               "--device", args.device, "--steps", str(args.steps), "--warmup",
               str(args.warmup)] + (["--tiny"] if args.tiny else [])
        sys.stdout.flush()
        try:
            p = subprocess.run(cmd, env=env, timeout=args.variant_timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {args.variant_timeout} s"}
        if p.returncode != 0 or not os.path.exists(out):
            return {"error": f"process exited with {p.returncode} (log above)"}
        return json.loads(Path(out).read_text())[spec]


def print_table(res: dict[str, dict[str, Any]]) -> None:
    names = list(res)
    print(f"{'ms per step':<20}" + "".join(f"{n[-22:]:>24}" for n in names))
    rows = [*BUCKETS, "busy_ms", "idle_ms", "step_ms", "kernels_per_step"]
    for b in rows:
        cells = []
        for n in names:
            r = res[n]
            v = None if "error" in r else (r["ms"][b] if b in BUCKETS else r.get(b))
            cells.append(f"{v:>24.3f}" if isinstance(v, float) else f"{v!s:>24}")
        print(f"{b:<20}" + "".join(cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", required=True, help="MODEL:VARIANT,... (train_step names)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variant-timeout", type=float, default=300.0)
    ap.add_argument("--out", default="breakdown.json")
    args = ap.parse_args(argv)
    specs = [s for s in args.variants.split(",") if s]
    for s in specs:
        m, sep, v = s.partition(":")
        if not sep or m not in train_step.MODELS or not v:
            ap.error(f"--variants: {s!r} is not MODEL:VARIANT with MODEL one of "
                     f"{', '.join(train_step.MODELS)}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    res: dict[str, dict[str, Any]] = {}
    for s in specs:
        m, _, v = s.partition(":")
        if len(specs) > 1:
            res[s] = _isolated(s, args)
        else:
            try:
                res[s] = profile_variant(m, v, args.device, args.tiny, args.steps, args.warmup)
            except Exception as e:  # reported, not fatal
                res[s] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print_table(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
