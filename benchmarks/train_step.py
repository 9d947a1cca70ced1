"""Train-step speed and memory: fmp against torch.amp (and the Apex adapter), in one run.

    python benchmarks/train_step.py                      # CUDA: GPT-2 small + ResNet-50
    python benchmarks/train_step.py --tiny --device cpu  # smoke test (the suite runs this)

Per variant: median step time over the timed steps (CUDA events), throughput, MFU against a
bf16 matmul peak measured in this run, peak memory (the variant's own: what it allocated on
top of what was allocated before it was built), host syncs in one step (counted with
torch.cuda.set_sync_debug_mode("warn")), and the loss after the timed steps. Also the
unscale + overflow check over 124M float32 grads against a copy of the same tensors.
Prints a table and writes ``<out>/<machine>-<date>.json`` with a "ratios" object.
``benchmarks/diagnose.py`` says where a variant's memory and GPU time go.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models

import fmp

Step = Callable[[], torch.Tensor]  # runs one step, returns the loss tensor (no sync)


# --------------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Step, device: str, warmup: int, steps: int) -> tuple[list[float], float]:
    """Per-step milliseconds (device events on CUDA) and the loss after the last step."""
    loss = None
    for _ in range(warmup):
        loss = step()
    _sync(device)
    times = []
    for _ in range(steps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, float(loss)


def count_syncs(step: Step, device: str) -> int | None:
    if device != "cuda":
        return None
    _sync(device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return sum("synchroniz" in str(w.message) for w in rec)


def bf16_peak_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        a @ b
    e1.record()
    e1.synchronize()
    return 2 * n**3 * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e12


# --------------------------------------------------------------------------- GPT variants
def _gpt_batch(c: models.GPTConfig, batch: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, c.vocab, (batch, c.seq + 1), generator=g).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _torch_adamw(params, device):
    kw = {"fused": True} if device == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, **kw)


def build_torch(model: torch.nn.Module, batch, device: str, mode: str, loss_of,
                make_opt) -> Step:
    """fp32 / torch.amp eager / compiled: the peer's loop."""
    x, y = batch
    low = torch.float16 if "fp16" in mode else torch.bfloat16 if "bf16" in mode else None
    opt = make_opt(model.parameters(), device)
    scaler = torch.amp.GradScaler(device, enabled=low is torch.float16)

    def forward(a, b):
        return loss_of(model(a), b)

    ro = mode.endswith("_ro") or "_ro_" in mode
    if "compiled" in mode:
        # "compiled": torch.compile(model), the loss outside it; "compiled_loss": model and
        # loss in one compiled function (nanoGPT's habit; the peer's best, see anchors-h200.md);
        # "_ro" suffix: mode="reduce-overhead" (CUDA graphs)
        # "_combo" suffix: inductor's horizontal fusion of independent small kernels
        kw = {"mode": "reduce-overhead"} if ro else {}
        if mode.endswith("_combo"):
            kw = {"options": {"combo_kernels": True, "triton.cudagraphs": ro}}
        if "compiled_loss" in mode:
            forward = torch.compile(forward, **kw)
        else:
            cmodel = torch.compile(model, **kw)

            def forward(a, b):
                return loss_of(cmodel(a), b)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if ro:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=low or torch.float32, enabled=low is not None):
            loss = forward(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def build_fmp(model: torch.nn.Module, batch, device: str, mode: str, loss_of,
              make_opt) -> Step:
    """fmp functional step: eager, compiled (whole step), compiled + CUDA graph."""
    x, y = batch
    policy = "bf16-mixed" if "bf16" in mode else "fp16-mixed"
    apply_fn, params, buffers = fmp.functional(model)
    opt = make_opt()
    donate = "donate" in mode or "compiled" in mode or "graph" in mode
    has_state = len(buffers) > 0
    if has_state:
        pols = fmp.module_policies(model, policy, {torch.nn.BatchNorm2d: "fp32"})

        def loss_fn(p, ms, a, b):
            out, new_ms = apply_fn(p, a, buffers=ms, return_buffers=True)
            return loss_of(out, b), new_ms
    else:
        pols = None

        def loss_fn(p, a, b):
            return loss_of(apply_fn(p, a), b)

    # "_nocopy": cast the params every step instead of keeping their compute copy
    step_fn = fmp.train_step(loss_fn, opt, policy, donate=donate, has_state=has_state,
                             param_policies=pols, compute_copy="nocopy" not in mode)
    scale = fmp.DynamicLossScale.create() if policy == "fp16-mixed" else None
    holder = {"state": fmp.TrainState.create(params, opt, scale,
                                             model_state=dict(buffers) if has_state else None)}
    if "compiled" in mode or "graph" in mode:
        # two graphs (loss fwd/bwd partitioned by AOTAutograd, then the update), or with
        # "_whole" one graph of torch.func.grad; fullgraph=True + known workarounds;
        # "_ro": mode="reduce-overhead" (inductor's CUDA graphs, per graph)
        kw = {"mode": "reduce-overhead"} if "_ro" in mode else {}
        step_fn = fmp.compile(step_fn, whole_graph="whole" in mode, **kw)
    if "graph" in mode:
        # fmp.cuda_graph: warm-up on a side stream (training the state, as torch's recipe
        # does: no copy of the state), one capture, then a replay per step
        graphed = fmp.cuda_graph(step_fn, holder["state"], x, y, warmup=3,
                                 warmup_trains=True)

        def step() -> torch.Tensor:
            holder["state"], m = graphed(holder["state"], x, y)
            return m["loss"]

        return step

    def step() -> torch.Tensor:
        if "_ro" in mode:
            torch.compiler.cudagraph_mark_step_begin()
        holder["state"], m = step_fn(holder["state"], x, y)
        return m["loss"]

    return step


def build_apex(model: torch.nn.Module, batch, device: str, mode: str, loss_of,
               make_opt) -> Step:
    from adapters import apex

    x, y = batch
    level = {"apex_o1": "O1", "apex_o2": "O2"}[mode]
    opt = make_opt(model.parameters(), device)
    amp = apex.amp.Amp() if hasattr(apex.amp, "Amp") else apex.amp
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = loss_of(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    return step


def build(model_name: str, variant: str, device: str, tiny: bool) -> tuple[Step, dict]:
    torch.manual_seed(0)
    if model_name == "gpt":
        c = models.GPTConfig.tiny() if tiny else models.GPTConfig()
        batch_size = 2 if tiny else 16
        model = models.GPT(c).to(device)
        batch = _gpt_batch(c, batch_size, device)
        info = {"items_per_step": batch_size * c.seq, "unit": "tokens/s",
                "flops_per_step": models.gpt_flops_per_token(model) * batch_size * c.seq,
                "params": sum(p.numel() for p in model.parameters())}
        loss_of = models.gpt_loss
        torch_opt = _torch_adamw

        def fmp_opt():
            return fmp.optim.adamw(3e-4, weight_decay=0.1)
    else:
        batch_size = 4 if tiny else 256
        model = models.resnet50().to(device).to(memory_format=torch.channels_last)
        hw = 32 if tiny else 224
        g = torch.Generator().manual_seed(0)
        xb = torch.randn(batch_size, 3, hw, hw, generator=g).to(device)
        xb = xb.contiguous(memory_format=torch.channels_last)
        yb = torch.randint(0, 1000, (batch_size,), generator=g).to(device)
        batch = (xb, yb)
        info = {"items_per_step": batch_size, "unit": "images/s", "flops_per_step": None,
                "params": sum(p.numel() for p in model.parameters())}

        def loss_of(out, t):
            return torch.nn.functional.cross_entropy(out.float(), t)

        def torch_opt(params, device):
            return torch.optim.SGD(params, lr=0.02, momentum=0.9, foreach=True)

        def fmp_opt():
            return fmp.optim.sgd(0.02, momentum=0.9)

    if variant.startswith("fmp"):
        return build_fmp(model, batch, device, variant, loss_of, fmp_opt), info
    if variant.startswith("apex"):
        return build_apex(model, batch, device, variant, loss_of, torch_opt), info
    return build_torch(model, batch, device, variant, loss_of, torch_opt), info


# --------------------------------------------------------------------------- unscale
def bench_unscale(device: str, tiny: bool) -> dict[str, float]:
    """Unscale + overflow check over ~124M float32 grads in 100 tensors vs a copy of them."""
    total = 124_000_000 if not tiny else 100_000
    n = 100
    sizes = [total // n] * n
    grads = [torch.randn(s, device=device) for s in sizes]
    dst = [torch.empty_like(g) for g in grads]
    scale = fmp.DynamicLossScale.create().to(device)
    found_inf = torch.zeros(1, device=device)
    inv = torch.ones(1, device=device)

    def copy():
        torch._foreach_copy_(dst, grads)

    def torch_amp():
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)

    def fmp_pure():
        fmp.all_finite(scale.unscale(grads))

    unit = fmp.NoOpLossScale()  # scale 1: the grads keep their values run after run

    def fmp_donated():
        # train_step(donate=True), eager: the step owns its grads, so it unscales and checks
        # them in place in one pass (torch's amp kernel) before the fused optimizer kernel
        unit.unscale_and_check(grads, in_place=True)

    def fmp_check_only():
        # the read-only verdict fmp falls back to (bf16 grads on CUDA, distributed)
        fmp.all_finite(grads)

    cands = {"copy": copy, "torch_amp_inplace": torch_amp,
             "fmp_pure_unscale_then_check": fmp_pure, "fmp_donated_unscale_check": fmp_donated,
             "fmp_all_finite_only": fmp_check_only}
    out = {}
    for name, fn in cands.items():
        # bandwidth: 10 calls queued back to back per timed window, so the host's launch
        # time overlaps the kernels as in a training step (a synced single call would time
        # the Python before the first launch too); the synced figure is kept beside it
        ms, _ = time_steps(lambda fn=fn: ([fn() for _ in range(10)], torch.zeros(()))[1],
                           device, 2, 20)
        out[name + "_ms"] = statistics.median(ms) / 10
        ms, _ = time_steps(lambda fn=fn: (fn(), torch.zeros(()))[1], device, 3, 20)
        out[name + "_synced_call_ms"] = statistics.median(ms)
    nbytes = 2 * sum(sizes) * 4  # read + write, as a copy moves them
    out["copy_tbps"] = nbytes / (out["copy_ms"] * 1e-3) / 1e12
    return out


# --------------------------------------------------------------------------- main
GPT_VARIANTS = ["fp32", "amp_fp16_eager", "amp_bf16_eager", "fmp_fp16_eager",
                "fmp_bf16_eager", "fmp_fp16_eager_donate", "apex_o1", "apex_o2",
                "amp_fp16_compiled", "amp_fp16_compiled_loss", "fmp_fp16_compiled",
                "fmp_fp16_graph"]
# also accepted: amp_fp16_compiled_ro, amp_fp16_compiled_loss_ro (reduce-overhead), the
# same with _combo (inductor's combo_kernels, which fmp.compile turns on for its steps),
# fmp_fp16_compiled_whole, fmp_fp16_graph_whole (fmp.compile(..., whole_graph=True)),
# fmp_fp16_compiled_ro (fmp.compile(..., mode="reduce-overhead")), and any fmp variant
# with _nocopy (train_step(compute_copy=False): cast the params every step)
RESNET_VARIANTS = ["fp32", "amp_fp16_eager", "amp_bf16_eager", "apex_o1", "apex_o2",
                   "fmp_fp16_eager", "fmp_fp16_eager_donate"]


def _fresh(device: str) -> int:
    """Drop what earlier variants left (compiled graphs, CUDA-graph pools); bytes still held."""
    torch._dynamo.reset()
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _drop_apex_casts() -> None:
    # Apex O1's casts act process-wide (as Apex's patches did): the next variant runs without
    amp = sys.modules.get("adapters.apex.amp")
    if amp is not None:
        amp.deactivate()


def run_variant(model_name: str, variant: str, args) -> dict[str, Any]:
    try:
        return _run_variant(model_name, variant, args)
    finally:
        _drop_apex_casts()


def _run_variant(model_name: str, variant: str, args) -> dict[str, Any]:
    base = _fresh(args.device)
    t0 = time.perf_counter()
    try:
        step, info = build(model_name, variant, args.device, args.tiny)
        ms, loss = time_steps(step, args.device, args.warmup, args.steps)
        syncs = count_syncs(step, args.device)
    except Exception as e:  # a variant that cannot run is reported, not fatal
        if ("compiled" in variant or "graph" in variant) and not getattr(args, "_retry", False):
            # torch 2.11's inductor asserted in loop reordering on a whole-step graph for
            # the prototype: retry once with that pass off, and say so in the result
            import torch._inductor.config as ic

            ic.loop_ordering_after_fusion = False
            args._retry = True
            try:
                r = _run_variant(model_name, variant, args)
            finally:
                ic.loop_ordering_after_fusion = True
                args._retry = False
            r["first_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            r["workaround"] = "loop_ordering_after_fusion=False"
            return r
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    med = statistics.median(ms)
    r = {"ms": med, "ms_min": min(ms), "ms_max": max(ms), "loss": loss, "syncs_per_step": syncs,
         "throughput": info["items_per_step"] / (med * 1e-3), "unit": info["unit"],
         "wall_s": time.perf_counter() - t0}
    if args.device == "cuda":
        # the variant's own peak: model, state, compile, graphs, steps (not what is left
        # of earlier variants, which _fresh could not free)
        r["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
        r["baseline_gb"] = base / 1e9
    if info["flops_per_step"] and args.peak:
        r["mfu"] = info["flops_per_step"] / (med * 1e-3) / (args.peak * 1e12)
    del step
    return r


def combine_rounds(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result per variant: the round with the median time, plus every round's time."""
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return rs[0]
    ok.sort(key=lambda r: r["ms"])
    out = dict(ok[len(ok) // 2])
    if len(rs) > 1:
        out["ms_rounds"] = [r.get("ms") for r in rs]
    return out


def ratios(res: dict[str, dict[str, Any]], unscale: dict[str, float]) -> dict[str, float]:
    def thr(m, v):
        return res.get(m, {}).get(v, {}).get("throughput")

    def ratio(m, a, b):
        x, y = thr(m, a), thr(m, b)
        return x / y if x and y else None

    out: dict[str, Any] = {}
    gpt = res.get("gpt", {})
    best_amp_c = max((v for v in ("amp_fp16_compiled", "amp_fp16_compiled_ro",
                                  "amp_fp16_compiled_loss", "amp_fp16_compiled_loss_ro",
                                  "amp_fp16_compiled_loss_combo",
                                  "amp_fp16_compiled_loss_ro_combo")
                      if thr("gpt", v)), key=lambda v: thr("gpt", v), default=None)
    best_fmp_c = max((v for v in ("fmp_fp16_compiled", "fmp_fp16_compiled_ro",
                                  "fmp_fp16_graph") if thr("gpt", v)),
                     key=lambda v: thr("gpt", v), default=None)
    if best_amp_c and best_fmp_c:
        out["fmp_compiled_vs_torch_amp_compiled"] = ratio("gpt", best_fmp_c, best_amp_c)
        out["fmp_compiled_variant"], out["torch_amp_compiled_variant"] = best_fmp_c, best_amp_c
        pa, pf = gpt[best_amp_c].get("peak_gb"), gpt[best_fmp_c].get("peak_gb")
        if pa and pf:
            out["fmp_compiled_peak_mem_vs_torch_amp_compiled"] = pf / pa
    best_fmp_e = max((v for v in ("fmp_fp16_eager", "fmp_fp16_eager_donate") if thr("gpt", v)),
                     key=lambda v: thr("gpt", v), default=None)
    if best_fmp_e:
        out["fmp_eager_vs_torch_amp_eager"] = ratio("gpt", best_fmp_e, "amp_fp16_eager")
        out["fmp_eager_variant"] = best_fmp_e
    out["apex_o1_vs_torch_amp_eager"] = ratio("gpt", "apex_o1", "amp_fp16_eager")
    out["apex_o2_vs_torch_amp_eager_resnet50"] = ratio("resnet", "apex_o2", "amp_fp16_eager")
    if unscale:
        # the path the donated train step takes (the pure path is reported beside it)
        out["unscale_check_vs_copy_bandwidth"] = (unscale["copy_ms"]
                                                  / unscale["fmp_donated_unscale_check_ms"])
        out["unscale_check_pure_vs_copy_bandwidth"] = (unscale["copy_ms"]
                                                       / unscale["fmp_pure_unscale_then_check_ms"])
    syncs = [v.get("syncs_per_step") for k, v in gpt.items() if k.startswith("fmp")
             and v.get("syncs_per_step") is not None]
    out["fmp_host_syncs_per_step"] = max(syncs) if syncs else None
    return {k: v for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--models", default="gpt,resnet")
    ap.add_argument("--gpt-variants", default=",".join(GPT_VARIANTS))
    ap.add_argument("--resnet-variants", default=",".join(RESNET_VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times, interleaved; report the "
                    "median round (the spread between runs was ~4%% on the H200)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--no-unscale", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--machine", default=os.environ.get("FMP_MACHINE", platform.node()))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error(f"--steps and --rounds must be >= 1 and --warmup >= 0, got {args.steps}, "
                 f"{args.rounds}, {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.device == "cuda":
        # torch 2.11's inductor asserts in loop reordering on the whole-step graph
        # (benchmarks/NOTES.md); fmp applies its own workaround where needed.
        torch.backends.cuda.matmul.allow_tf32 = False
    args.peak = bf16_peak_tflops(args.device)
    res: dict[str, dict[str, Any]] = {}
    variants = {"gpt": args.gpt_variants, "resnet": args.resnet_variants}
    for m in args.models.split(","):
        res[m] = {}
        names = [v for v in variants[m].split(",") if v]
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
        for k in range(args.rounds):  # the whole list once per round: A B C, A B C, ...
            for v in names:
                r = run_variant(m, v, args)
                rounds[v].append(r)
                print(f"[{m}] round {k + 1} {v}: " + (r["error"] if "error" in r else
                      f"{r['ms']:.2f} ms  loss {r['loss']:.4f}"), flush=True)
        for v in names:
            res[m][v] = combine_rounds(rounds[v])
    unscale = {} if args.no_unscale else bench_unscale(args.device, args.tiny)
    out = {
        "date": _dt.date.today().isoformat(), "machine": args.machine,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv,
        "bf16_peak_tflops": args.peak, "results": res, "unscale": unscale,
        "ratios": ratios(res, unscale),
    }
    print_table(out)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.machine}-{out['date']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"\n{out['device']}  torch {out['torch']}  bf16 peak "
          f"{out['bf16_peak_tflops'] or float('nan'):.0f} TFLOP/s")
    print(f"{'model':<7}{'variant':<24}{'ms':>9}{'thr/s':>11}{'MFU':>7}{'GB':>7}"
          f"{'syncs':>6}{'loss':>9}")
    for m, vs in out["results"].items():
        for v, r in vs.items():
            if "error" in r:
                print(f"{m:<7}{v:<24} ERROR {r['error'][:80]}")
                continue
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
            gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
            sy = str(r["syncs_per_step"]) if r["syncs_per_step"] is not None else "-"
            print(f"{m:<7}{v:<24}{r['ms']:>9.2f}{r['throughput']:>11.0f}{mfu:>7}{gb:>7}"
                  f"{sy:>6}{r['loss']:>9.4f}")
    if out["unscale"]:
        print("unscale+check: " + ", ".join(f"{k}={v:.3f}" for k, v in out["unscale"].items()))
    print("ratios: " + json.dumps(out["ratios"], indent=1))


if __name__ == "__main__":
    main()
