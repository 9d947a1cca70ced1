"""Train-step speed and memory: fmp against torch.amp (and the Apex adapter), in one run.

    python benchmarks/train_step.py                      # CUDA: GPT-2 small + ResNet-50
    python benchmarks/train_step.py --tiny --device cpu  # smoke test (the suite runs this)
    python benchmarks/train_step.py --isolate ...        # a process per compiled variant

Issue 18: ``amp_graph_fp16`` / ``amp_graph_bf16`` are torch.amp's whole step (compiled model
+ loss, fused capturable AdamW, GradScaler for fp16) in one CUDA graph; ``fmp_fp16_graph`` /
``fmp_bf16_graph`` are ``fmp.cuda_graph(fmp.compile(step))`` with donation. ``--isolate`` runs
each compiled or graphed variant in its own process with an empty inductor cache
(``compile_s`` is then a cold build + compile + warm-up + capture); every variant's loss is
checked against the eager torch.amp step of its precision after as many steps and marked
``invalid`` (and left out of the ratios) beyond ``LOSS_RTOL``. ``gpt_medium`` is GPT-2 medium.

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
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models

import fmp

Step = Callable[[], torch.Tensor]  # runs one step, returns the loss tensor (no sync)
MODELS = ("gpt", "gpt_medium", "resnet")


# --------------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Step, device: str, warmup: int, steps: int,
               on_warm: Callable[[], None] | None = None,
               window: list[float] | None = None,
               warm_loss: list[float] | None = None) -> tuple[list[float], float]:
    """Per-step milliseconds (device events on CUDA) and the loss after the last step.

    Each timed step is bracketed by its own events and waited for, so a step's host work
    before its first kernel shows as device time. With ``window`` (a list), ``steps`` more
    steps then run back to back, as a training loop runs them, between one pair of events,
    and their mean milliseconds are appended to it: the host work of one step then overlaps
    the device work of the one before, except where a step itself waits on the device
    (torch.amp's GradScaler reads its overflow flag every step). The loss returned is the
    one after the last step run.

    ``on_warm`` is called once the warm-up steps have finished on the device, just before
    the first timed step (the variant's build-to-first-timed-step wall time ends there).
    With ``warm_loss`` (a list), the loss after the warm-up is appended to it (read after
    the device finished the warm-up, before ``on_warm``).
    """
    loss = None

    def run(n: int) -> float:
        """Milliseconds for ``n`` steps: device events on CUDA, waited for once."""
        nonlocal loss
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                loss = step()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        for _ in range(n):
            loss = step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(warmup):
        loss = step()
    _sync(device)
    if warm_loss is not None and loss is not None:
        warm_loss.append(float(loss))
    if on_warm is not None:
        on_warm()
    times = [run(1) for _ in range(steps)]
    if window is not None and steps:
        window.append(run(steps) / steps)
    return times, float(loss)


def count_syncs(step: Step, device: str, sites: list[str] | None = None) -> int | None:
    """Host syncs of one step (torch's sync debug mode); ``sites`` gets where each was
    raised (the innermost Python frames), to tell the harness's from the library's."""
    if device != "cuda":
        return None
    _sync(device)
    n = 0

    def show(message, category, filename, lineno, file=None, line=None):
        nonlocal n
        if "synchroniz" not in str(message):
            return
        n += 1
        if sites is not None and len(sites) < 4:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if not f.filename.endswith("warnings.py")][-6:]
            sites.append(f"{str(message)[:60]} <- " + " <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return n


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

    step.report = lambda: (  # type: ignore[attr-defined]
        {"loss_scale": float(scaler.get_scale())} if low is torch.float16 else {})
    return step


GRAPH_WARMUP = 3  # training steps before capture, for the graphed peer and fmp.cuda_graph


def build_torch_graph(model: torch.nn.Module, batch, device: str, mode: str, loss_of,
                      info: dict[str, Any]) -> Step:
    """The fastest torch.amp step a user can write: the whole step in one CUDA graph.

    Model and loss in one function under ``torch.compile`` (default mode), fused capturable
    AdamW (the hyper-parameters of ``_torch_adamw``), a GradScaler for fp16 (none for bf16),
    then torch's whole-network capture recipe: warm-up steps on a side stream (they train,
    compile forward and backward, and create the optimizer and scaler state), grads set to
    None, and forward / backward / ``scaler.step`` / ``scaler.update`` captured in one
    ``torch.cuda.CUDAGraph``. Backward in the capture allocates the ``.grad`` tensors from
    the graph's pool and every replay overwrites them, so no zero_grad is replayed.

    GradScaler is capture-safe with this optimizer: fused AdamW sets
    ``_step_supports_amp_scaling``, so ``scaler.step`` hands it the scale and the found-inf
    tensor (no ``.item()``), and ``scaler.update`` updates the scale and growth tracker in
    place on the device (torch's ``test_graph_scaling_fused_optimizers`` captures the same).

    On CPU (the smoke test) the same step body runs eagerly, not compiled and not graphed
    (``info["graphed"]`` says which ran).
    """
    x, y = batch
    if not isinstance(model, models.GPT):
        raise ValueError(f"{mode}: the graphed torch.amp peer is built for GPT models (AdamW), "
                         f"got {type(model).__name__}")
    low = torch.float16 if "fp16" in mode else torch.bfloat16
    fp16 = low is torch.float16
    cuda = device == "cuda"
    kw = {"fused": True, "capturable": True} if cuda else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **kw)
    scaler = torch.amp.GradScaler(device, enabled=fp16)

    def forward(a, b):
        return loss_of(model(a), b)

    fwd = torch.compile(forward) if cuda else forward
    sx, sy = x.clone(), y.clone()  # the graph's static inputs

    def body() -> torch.Tensor:
        with torch.autocast(device, dtype=low):
            loss = fwd(sx, sy)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    def report() -> dict[str, Any]:
        return {"loss_scale": float(scaler.get_scale())} if fp16 else {}

    info["graphed"] = cuda
    if not cuda:
        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            sx.copy_(x)
            sy.copy_(y)
            return body()

        step.report = report  # type: ignore[attr-defined]
        return step

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    info["train_steps_in_build"] = GRAPH_WARMUP  # the capture itself runs nothing
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = body()

    def step() -> torch.Tensor:
        sx.copy_(x)  # the batch into the static inputs, as fmp.cuda_graph does
        sy.copy_(y)
        graph.replay()
        return static_loss

    step.report = report  # type: ignore[attr-defined]
    step.graph = graph  # type: ignore[attr-defined]  # keeps the graph alive with the step
    step.scaler, step.params = scaler, list(model.parameters())  # type: ignore[attr-defined]
    return step


def build_fmp(model: torch.nn.Module, batch, device: str, mode: str, loss_of,
              make_opt, info: dict[str, Any] | None = None) -> Step:
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
        # "_halfnorm": norm layers compute in the 16-bit dtype too (float32 masters kept),
        # as Apex O2 runs LayerNorm; the default keeps them in float32 like torch.autocast
        pols = (fmp.module_policies(model, policy, keep_norms_fp32=False)
                if "halfnorm" in mode else None)

        def loss_fn(p, a, b):
            return loss_of(apply_fn(p, a), b)

    # "_nocopy": cast the params every step instead of keeping their compute copy
    step_fn = fmp.train_step(loss_fn, opt, policy, donate=donate, has_state=has_state,
                             param_policies=pols, compute_copy="nocopy" not in mode)
    scale = fmp.DynamicLossScale.create() if policy == "fp16-mixed" else None
    # a donated step is handed the module's tensors (no second copy of params and buffers)
    holder = {"state": fmp.TrainState.create(params, opt, scale,
                                             model_state=dict(buffers) if has_state else None,
                                             donate=donate)}
    if "compiled" in mode or "graph" in mode:
        # two graphs (loss fwd/bwd partitioned by AOTAutograd, then the update), or with
        # "_whole" one graph of torch.func.grad; fullgraph=True + known workarounds;
        # "_ro": mode="reduce-overhead" (inductor's CUDA graphs, per graph)
        # "_eagerupd": only the loss compiled, the update phase eager (torch's fused
        # in-place kernels for the donated step; no inductor compile of the update)
        kw = {"mode": "reduce-overhead"} if "_ro" in mode else {}
        if "_eagerupd" in mode:
            kw["update"] = "eager"
        step_fn = fmp.compile(step_fn, whole_graph="whole" in mode, **kw)
    if "graph" in mode:
        # fmp.cuda_graph: warm-up on a side stream (training the state, as torch's recipe
        # does: no copy of the state), one capture, then a replay per step
        graphed = fmp.cuda_graph(step_fn, holder["state"], x, y, warmup=GRAPH_WARMUP,
                                 warmup_trains=True)
        if info is not None:
            info["train_steps_in_build"] = GRAPH_WARMUP  # the capture itself runs nothing
            info["graphed"] = True

        def step() -> torch.Tensor:
            holder["state"], m = graphed(holder["state"], x, y)
            return m["loss"]
    else:
        def step() -> torch.Tensor:
            if "_ro" in mode:
                torch.compiler.cudagraph_mark_step_begin()
            holder["state"], m = step_fn(holder["state"], x, y)
            return m["loss"]

    def report() -> dict[str, Any]:
        st = holder["state"]
        out = {"skipped": int(st.skipped_total)} if st.skipped_total is not None else {}
        if isinstance(st.loss_scale, fmp.DynamicLossScale):
            out["loss_scale"] = float(st.loss_scale.loss_scale)
        return out

    step.report = report  # type: ignore[attr-defined]
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
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; accepted: {', '.join(MODELS)}")
    if variant.startswith("amp_graph") and model_name == "resnet":
        raise ValueError(f"{variant}: the graphed torch.amp peer is built for GPT models "
                         "(AdamW), not resnet")
    if model_name in ("gpt", "gpt_medium"):
        if model_name == "gpt":
            c = models.GPTConfig.tiny() if tiny else models.GPTConfig()
        else:
            c = models.GPTConfig.tiny_medium() if tiny else models.GPTConfig.medium()
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

    info["train_steps_in_build"] = 0
    if variant.startswith("amp_graph"):
        return build_torch_graph(model, batch, device, variant, loss_of, info), info
    if variant.startswith("fmp"):
        return build_fmp(model, batch, device, variant, loss_of, fmp_opt, info), info
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
# with _nocopy (train_step(compute_copy=False): cast the params every step) or _halfnorm
# (GPT: LayerNorms compute in 16 bits from their float32 masters, as under Apex O2), and
# fmp_*_compiled / fmp_*_graph with _eagerupd (fmp.compile(..., update="eager"): the loss
# compiled, the update by torch's fused kernels)
RESNET_VARIANTS = ["fp32", "amp_fp16_eager", "amp_bf16_eager", "apex_o1", "apex_o2",
                   "fmp_fp16_eager", "fmp_fp16_eager_donate"]
# GPT-2 medium (issue 18): fmp's graphed step and torch.amp's strongest steps, both dtypes
GPT_MEDIUM_VARIANTS = ["amp_bf16_eager", "amp_graph_bf16", "fmp_bf16_graph",
                       "fmp_bf16_graph_eagerupd", "amp_fp16_eager", "amp_graph_fp16",
                       "fmp_fp16_graph", "fmp_fp16_graph_eagerupd"]


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
    warm_at: list[float] = []
    try:
        step, info = build(model_name, variant, args.device, args.tiny)
        window: list[float] = []
        warm_loss: list[float] = []
        ms, loss = time_steps(step, args.device, args.warmup, args.steps,
                              on_warm=lambda: warm_at.append(time.perf_counter()),
                              window=window, warm_loss=warm_loss)
        extra = step.report() if hasattr(step, "report") else {}
        sync_sites: list[str] = []
        syncs = count_syncs(step, args.device, sync_sites)
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
         # the same number of steps again, back to back between one pair of events
         "ms_window": window[0] if window else None,
         "throughput": info["items_per_step"] / (med * 1e-3), "unit": info["unit"],
         "wall_s": time.perf_counter() - t0,
         # build + compile + warm-up + capture: wall clock until the first timed step
         "compile_s": warm_at[0] - t0,
         # training steps before the reported loss (the loss check compares at this count)
         "train_steps": (info["train_steps_in_build"] + args.warmup + args.steps
                         + (args.steps if window else 0)),
         # the loss after the build's steps and the warm-up, where the loss check is sharp
         "warm_loss": warm_loss[0] if warm_loss else None,
         "warm_steps": info["train_steps_in_build"] + args.warmup, **extra}
    if "graphed" in info:
        r["graphed"] = info["graphed"]
    if sync_sites:
        r["sync_sites"] = sync_sites
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


# --------------------------------------------------------------------------- isolation
def is_compiled(variant: str) -> bool:
    """Variants that run dynamo (compiled or graphed): these get a process each."""
    return "compiled" in variant or "graph" in variant


def run_isolated(model_name: str, variant: str, args) -> dict[str, Any]:
    """Run one variant in its own ``--single`` process with an empty inductor/Triton cache.

    Two models compiled from one function's code in one process shared dynamo's compiled
    code (issue 18: NaN losses in a whole-step graph, a segfault with two graphs); a process
    per variant shares nothing, and its fresh cache makes ``compile_s`` a cold compile.
    The child's output goes to this process's stdout/stderr (the log).
    """
    with tempfile.TemporaryDirectory(prefix="fmp-bench-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--single",
               f"{model_name}:{variant}", "--result-json", out, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        if args.tiny:
            cmd.append("--tiny")
        if args.peak:
            cmd += ["--peak-tflops", repr(args.peak)]
        t0 = time.perf_counter()
        sys.stdout.flush()
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.variant_timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout: the variant's process ran past "
                    f"--variant-timeout {args.variant_timeout} s", "isolated": True}
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"the variant's process exited with {proc.returncode} "
                    "(its output is in the log above)", "isolated": True}
        r = json.loads(Path(out).read_text())
    r["isolated"] = True
    r["process_s"] = time.perf_counter() - t0  # interpreter start and imports included
    return r


# --------------------------------------------------------------------------- loss check
# A variant's losses against the eager torch.amp step of the same precision after as many
# steps (same seed, same model init, same batch every step), at two points:
# - after the warm-up (5-8 steps): LOSS_RTOL, 0.5%. There the GPT-2 trajectories are smooth
#   (the fp16 and bf16 references agree within 0.02% at steps 5-8, 2026-12-07) and training
#   has moved the loss 5-9% from its start, so a NaN, an update that does not happen or a
#   step that trains on other weights is far outside.
# - after the last step (48 with the back-to-back window): FINAL_RTOL, 10%, a coarse check
#   (and NaN/inf). Past ~15 steps at lr 3e-4 the loss spikes and rounding differences grow:
#   on an H100 on 2026-12-07 the fp16 and bf16 references stood 4% apart at step 48, and
#   correct variants landed 9.03-9.53, so 2% there marked correct steps invalid.
LOSS_RTOL = 0.005
FINAL_RTOL = 0.10


def precision_of(variant: str) -> str:
    """'fp32', 'bf16' or 'fp16' (apex and unmarked mixed variants are fp16)."""
    if variant == "fp32":
        return "fp32"
    return "bf16" if "bf16" in variant else "fp16"


def reference_variant(precision: str) -> str:
    return "fp32" if precision == "fp32" else f"amp_{precision}_eager"


def reference_losses(model_name: str, precision: str, n: int, args) -> list[float]:
    """The eager reference's loss after each of its first ``n`` steps (synced every step)."""
    _fresh(args.device)
    try:
        step, _ = build(model_name, reference_variant(precision), args.device, args.tiny)
        out = [float(step()) for _ in range(n)]
        del step
    finally:
        _drop_apex_casts()
    _fresh(args.device)
    return out


def _rel(a: float | None, b: float) -> float | None:
    if a is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return abs(a - b) / abs(b)


def check_losses(res: dict[str, dict[str, Any]], refs: dict[str, dict[str, list[float]]],
                 rtol: float = LOSS_RTOL, final_rtol: float = FINAL_RTOL) -> None:
    """Mark every result ``invalid`` whose losses depart from its reference's.

    Where a result has its loss after the warm-up (``warm_loss`` after ``warm_steps``),
    that one must be within ``rtol`` and the last one (``loss`` after ``train_steps``)
    finite and within ``final_rtol``; a result without it is held to ``rtol`` at the end.

    Args:
        res: ``{model: {variant: result}}``; results get ``loss_ref``, ``loss_rel_err``
            (and ``warm_loss_ref``, ``warm_loss_rel_err``), ``invalid`` (True or False), or
            ``loss_check: "no reference"``.
        refs: ``{model: {precision: [loss after step 1, 2, ...]}}``.
        rtol: the relative tolerance after the warm-up.
        final_rtol: the relative tolerance after the last step.
    """
    for m, vs in res.items():
        for v, r in vs.items():
            if "error" in r:
                continue
            traj = refs.get(m, {}).get(precision_of(v))
            n = r.get("train_steps")
            if not traj or not n or n > len(traj):
                r["loss_check"] = "no reference"
                continue
            ref = traj[n - 1]
            r["loss_ref"], r["loss_ref_variant"] = ref, reference_variant(precision_of(v))
            err = r["loss_rel_err"] = _rel(r["loss"], ref)
            w = r.get("warm_steps")
            if r.get("warm_loss") is None or not w or w > len(traj):
                r["invalid"] = err is None or err > rtol
                continue
            r["warm_loss_ref"] = traj[w - 1]
            werr = r["warm_loss_rel_err"] = _rel(r["warm_loss"], traj[w - 1])
            r["invalid"] = werr is None or werr > rtol or err is None or err > final_rtol


def _loss_references(res: dict[str, dict[str, Any]], args) -> dict[str, dict[str, list]]:
    refs: dict[str, dict[str, list[float]]] = {}
    for m, vs in res.items():
        ok = {v: r for v, r in vs.items() if "error" not in r and r.get("train_steps")}
        if not ok:
            continue
        n = max(r["train_steps"] for r in ok.values())
        refs[m] = {p: reference_losses(m, p, n, args)
                   for p in sorted({precision_of(v) for v in ok})}
    return refs


# --------------------------------------------------------------------------- ratios
def ratios(res: dict[str, dict[str, Any]], unscale: dict[str, float]) -> dict[str, Any]:
    """The headline ratios; variants with an error or marked ``invalid`` are left out.

    Speed ratios are throughput ratios (= peer ms / fmp ms: > 1 means fmp is faster);
    memory and compile-time ratios are fmp / peer (< 1 means fmp uses less).
    """
    def get(m, v):
        r = res.get(m, {}).get(v)
        return None if not r or "error" in r or r.get("invalid") else r

    def thr(m, v):
        r = get(m, v)
        return r.get("throughput") if r else None

    def field(m, v, k):
        r = get(m, v)
        return r.get(k) if r else None

    def ratio(m, a, b):
        x, y = thr(m, a), thr(m, b)
        return x / y if x and y else None

    def frac(m, a, b, k):
        x, y = field(m, a, k), field(m, b, k)
        return x / y if x and y else None

    def best(m, cands):
        return max((v for v in cands if thr(m, v)), key=lambda v: thr(m, v), default=None)

    out: dict[str, Any] = {}
    best_amp_c = best("gpt", ("amp_fp16_compiled", "amp_fp16_compiled_ro",
                              "amp_fp16_compiled_loss", "amp_fp16_compiled_loss_ro",
                              "amp_fp16_compiled_loss_combo",
                              "amp_fp16_compiled_loss_ro_combo", "amp_graph_fp16"))
    best_fmp_c = best("gpt", ("fmp_fp16_compiled", "fmp_fp16_compiled_ro", "fmp_fp16_graph"))
    if best_amp_c and best_fmp_c:
        out["fmp_compiled_vs_torch_amp_compiled"] = ratio("gpt", best_fmp_c, best_amp_c)
        out["fmp_compiled_variant"], out["torch_amp_compiled_variant"] = best_fmp_c, best_amp_c
        out["fmp_compiled_peak_mem_vs_torch_amp_compiled"] = frac("gpt", best_fmp_c,
                                                                  best_amp_c, "peak_gb")
    # issue 18: fmp's graphed step against torch.amp's whole step in one CUDA graph
    # (the fmp side: the faster of the compiled update and the eager fused one)
    def graphs(p):
        return (f"fmp_{p}_graph", f"fmp_{p}_graph_eagerupd")

    for p in ("fp16", "bf16"):
        g = best("gpt", graphs(p))  # None where neither ran valid: no ratio, no name
        out[f"fmp_graph_vs_torch_amp_graph_{p}"] = ratio("gpt", g, f"amp_graph_{p}")
        out[f"fmp_graph_peak_mem_vs_torch_amp_graph_{p}"] = frac(
            "gpt", g, f"amp_graph_{p}", "peak_gb")
        out[f"fmp_graph_variant_{p}"] = g
        if thr("gpt", f"fmp_{p}_graph_eagerupd"):  # the build time it saves, beside
            out[f"fmp_eagerupd_compile_time_vs_torch_amp_graph_{p}"] = frac(
                "gpt", f"fmp_{p}_graph_eagerupd", f"amp_graph_{p}", "compile_s")
    out["fmp_graph_peak_mem_vs_torch_amp_graph"] = out["fmp_graph_peak_mem_vs_torch_amp_graph_fp16"]
    best_fmp_g = best("gpt", (*graphs("fp16"), *graphs("bf16")))
    if best_fmp_g:
        peer = f"amp_graph_{precision_of(best_fmp_g)}"
        out["fmp_compile_time_vs_torch_amp_graph"] = frac("gpt", best_fmp_g, peer, "compile_s")
        out["fmp_compile_time_variants"] = [best_fmp_g, peer]
        out["fmp_compile_s"] = field("gpt", best_fmp_g, "compile_s")
        out["torch_amp_graph_compile_s"] = field("gpt", peer, "compile_s")
    best_fmp = best("gpt", [v for v in res.get("gpt", {}) if v.startswith("fmp")])
    if best_fmp:
        out["fmp_mfu_vs_measured_matmul_peak"] = field("gpt", best_fmp, "mfu")
        out["fmp_best_variant"] = best_fmp
    eager = ("fmp_fp16_eager", "fmp_fp16_eager_donate")
    best_fmp_e = best("gpt", eager)
    if best_fmp_e:
        out["fmp_eager_vs_torch_amp_eager"] = ratio("gpt", best_fmp_e, "amp_fp16_eager")
        out["fmp_eager_variant"] = best_fmp_e
    if thr("gpt", "fmp_fp16_eager_donate_halfnorm"):
        # LayerNorms in 16 bits (Apex O2's numerics), which torch.autocast does not offer
        out["fmp_eager_halfnorm_vs_torch_amp_eager"] = ratio(
            "gpt", "fmp_fp16_eager_donate_halfnorm", "amp_fp16_eager")
    best_fmp_er = best("resnet", eager)
    if best_fmp_er:
        out["fmp_eager_vs_torch_amp_eager_resnet50"] = ratio("resnet", best_fmp_er,
                                                             "amp_fp16_eager")
        out["fmp_eager_variant_resnet50"] = best_fmp_er
    # the same eager steps timed back to back (time_steps' window): the host work of one
    # step overlaps the device work of the one before, as in a training loop
    for m, key in (("gpt", "fmp_eager_vs_torch_amp_eager_window"),
                   ("resnet", "fmp_eager_vs_torch_amp_eager_resnet50_window")):
        wins = {v: field(m, v, "ms_window") for v in (*eager, "amp_fp16_eager")}
        fmp_w = [wins[v] for v in eager if wins[v]]
        if fmp_w and wins["amp_fp16_eager"]:
            out[key] = wins["amp_fp16_eager"] / min(fmp_w)
    out["apex_o1_vs_torch_amp_eager"] = ratio("gpt", "apex_o1", "amp_fp16_eager")
    out["apex_o2_vs_torch_amp_eager_resnet50"] = ratio("resnet", "apex_o2", "amp_fp16_eager")
    # GPT-2 medium: fmp's graphed step against torch.amp's strongest step of each dtype
    med = res.get("gpt_medium", {})
    for p in ("bf16", "fp16"):
        peer = best("gpt_medium", [v for v in med if v.startswith("amp") and
                                   precision_of(v) == p])
        g = best("gpt_medium", graphs(p))
        if peer and g:
            k = f"gpt_medium_fmp_graph_vs_torch_amp_best_{p}"
            out[k] = ratio("gpt_medium", g, peer)
            out[f"gpt_medium_fmp_graph_peak_mem_vs_torch_amp_best_{p}"] = frac(
                "gpt_medium", g, peer, "peak_gb")
            out[f"gpt_medium_torch_amp_best_{p}_variant"] = peer
            out[f"gpt_medium_fmp_graph_variant_{p}"] = g
    if unscale:
        # the path the donated train step takes (the pure path is reported beside it)
        out["unscale_check_vs_copy_bandwidth"] = (unscale["copy_ms"]
                                                  / unscale["fmp_donated_unscale_check_ms"])
        out["unscale_check_pure_vs_copy_bandwidth"] = (unscale["copy_ms"]
                                                       / unscale["fmp_pure_unscale_then_check_ms"])
    syncs = [r.get("syncs_per_step") for m in res for v, r in res[m].items()
             if v.startswith("fmp") and get(m, v) and r.get("syncs_per_step") is not None]
    out["fmp_host_syncs_per_step"] = max(syncs) if syncs else None
    peer = [r.get("syncs_per_step") for m in res for v, r in res[m].items()
            if v.startswith("amp_graph") and get(m, v) and r.get("syncs_per_step") is not None]
    out["torch_amp_graph_host_syncs_per_step"] = max(peer) if peer else None
    invalid = sorted(f"{m}:{v}" for m in res for v, r in res[m].items() if r.get("invalid"))
    if invalid:
        out["invalid_variants_left_out"] = invalid
    return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--models", default="gpt,resnet", help="any of " + ",".join(MODELS))
    ap.add_argument("--gpt-variants", default=",".join(GPT_VARIANTS))
    ap.add_argument("--gpt-medium-variants", default=",".join(GPT_MEDIUM_VARIANTS))
    ap.add_argument("--resnet-variants", default=",".join(RESNET_VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times, interleaved; report the "
                    "median round (the spread between runs was ~4%% on the H200)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--no-unscale", action="store_true")
    ap.add_argument("--isolate", action="store_true",
                    help="run every compiled/graphed variant in its own process with an "
                    "empty inductor cache (cold compile time; no dynamo code shared)")
    ap.add_argument("--variant-timeout", type=float, default=300.0,
                    help="seconds an isolated variant's process may run")
    ap.add_argument("--no-loss-check", action="store_true",
                    help="skip the eager reference runs and the invalid marking")
    ap.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the bf16 matmul peak for MFU (measured when not given)")
    ap.add_argument("--single", default=None, metavar="MODEL:VARIANT",
                    help="run one variant and write its result to --result-json (what "
                    "--isolate runs)")
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge result files of this script (later ones win per variant), "
                    "recompute the ratios, write <out>/<machine>-<date>-merged.json")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--machine", default=os.environ.get("FMP_MACHINE", platform.node()))
    return ap


def _single(args, ap) -> dict[str, Any]:
    m, sep, v = args.single.partition(":")
    if not sep or m not in MODELS or not v:
        ap.error(f"--single wants MODEL:VARIANT with MODEL one of {', '.join(MODELS)}, "
                 f"got {args.single!r}")
    if not args.result_json:
        ap.error("--single needs --result-json")
    args.peak = args.peak_tflops
    r = run_variant(m, v, args)
    print(f"[{m}] {v} (own process): " + (r["error"] if "error" in r else
          f"{r['ms']:.2f} ms  loss {r['loss']:.4f}  compile {r['compile_s']:.1f} s"), flush=True)
    Path(args.result_json).write_text(json.dumps(r, indent=1))
    return r


def _merge(args) -> dict[str, Any]:
    res: dict[str, dict[str, Any]] = {}
    refs: dict[str, Any] = {}
    unscale: dict[str, float] = {}
    first = None
    for f in args.merge:
        d = json.loads(Path(f).read_text())
        first = first or d
        for m, vs in d["results"].items():
            res.setdefault(m, {}).update(vs)
        for m, per in d.get("loss_references", {}).items():
            refs.setdefault(m, {}).update(per)
        unscale = d.get("unscale") or unscale
    assert first is not None
    out = dict(first, results=res, loss_references=refs, unscale=unscale,
               merged_from=list(args.merge), ratios=ratios(res, unscale))
    print_table(out)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.machine}-{out['date']}-merged.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error(f"--steps and --rounds must be >= 1 and --warmup >= 0, got {args.steps}, "
                 f"{args.rounds}, {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    models_run = [m for m in args.models.split(",") if m]
    bad = [m for m in models_run if m not in MODELS]
    if bad:
        ap.error(f"--models: unknown {', '.join(bad)}; accepted: {', '.join(MODELS)}")
    if args.device == "cuda":
        # torch 2.11's inductor asserts in loop reordering on the whole-step graph
        # (benchmarks/NOTES.md); fmp applies its own workaround where needed.
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.single:
        return _single(args, ap)
    args.peak = args.peak_tflops or bf16_peak_tflops(args.device)
    res: dict[str, dict[str, Any]] = {}
    variants = {"gpt": args.gpt_variants, "gpt_medium": args.gpt_medium_variants,
                "resnet": args.resnet_variants}
    for m in models_run:
        res[m] = {}
        names = [v for v in variants[m].split(",") if v]
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in names}
        for k in range(args.rounds):  # the whole list once per round: A B C, A B C, ...
            for v in names:
                if args.isolate and is_compiled(v):
                    r = run_isolated(m, v, args)
                else:
                    r = run_variant(m, v, args)
                    if is_compiled(v) and "error" not in r:
                        # dynamo's code may be shared with other variants of this process
                        # (issue 18); --isolate gives each its own process
                        r["isolated"] = False
                rounds[v].append(r)
                print(f"[{m}] round {k + 1} {v}: " + (r["error"] if "error" in r else
                      f"{r['ms']:.2f} ms  loss {r['loss']:.4f}"), flush=True)
        for v in names:
            res[m][v] = combine_rounds(rounds[v])
    refs = {} if args.no_loss_check else _loss_references(res, args)
    check_losses(res, refs, args.loss_rtol)
    unscale = {} if args.no_unscale else bench_unscale(args.device, args.tiny)
    out = {
        "date": _dt.date.today().isoformat(), "machine": args.machine,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv,
        "bf16_peak_tflops": args.peak, "results": res, "unscale": unscale,
        "loss_references": refs, "loss_rtol": args.loss_rtol,
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
    print(f"{'model':<11}{'variant':<24}{'ms':>9}{'win ms':>8}{'thr/s':>11}{'MFU':>7}{'GB':>7}"
          f"{'syncs':>6}{'loss':>9}{'vs ref':>9}{'build s':>9}")
    for m, vs in out["results"].items():
        for v, r in vs.items():
            if "error" in r:
                print(f"{m:<11}{v:<24} ERROR {r['error'][:80]}")
                continue
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
            gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
            sy = str(r["syncs_per_step"]) if r["syncs_per_step"] is not None else "-"
            err = r.get("loss_rel_err")
            ref = "-" if "invalid" not in r else (
                "INVALID" if r["invalid"] else f"{err:+.4f}" if err is not None else "-")
            cs = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
            win = f"{r['ms_window']:.2f}" if r.get("ms_window") else "-"
            print(f"{m:<11}{v:<24}{r['ms']:>9.2f}{win:>8}{r['throughput']:>11.0f}{mfu:>7}{gb:>7}"
                  f"{sy:>6}{r['loss']:>9.4f}{ref:>9}{cs:>9}")
    if out["unscale"]:
        print("unscale+check: " + ", ".join(f"{k}={v:.3f}" for k, v in out["unscale"].items()))
    print("ratios: " + json.dumps(out["ratios"], indent=1))


if __name__ == "__main__":
    main()
