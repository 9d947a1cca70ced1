"""float8 training side by side (issue 19): fmp.float8 against torchao's float8 and torch.amp bf16.

    python benchmarks/float8.py --json /tmp/out/float8.json           # CUDA (an H200)
    python benchmarks/float8.py --tiny --device cpu --steps 3 --no-compile --json x.json

A GPT (benchmarks/models.py; default d=2048, 12 layers, 16 heads, seq 1024, batch 8, about
0.7B params) trains ``--steps`` steps on the same synthetic data in every variant: a fixed
random Markov chain over the vocabulary (each token has 4 possible successors, so the loss
falls from ln(vocab) towards ln(4)), the same batches in the same order, the same seed, AdamW
(betas 0.9/0.95, weight decay 0.1) with the same schedule (linear warm-up over 10% of the
steps, cosine to 10%). Each variant runs in its own subprocess (dynamo shares compiled code
between the models of one process: that gave NaN losses before).

Variants: ``amp_bf16`` (torch.compile of model + loss, torch.autocast bf16, fused
torch.optim.AdamW); ``torchao_tensorwise`` / ``torchao_rowwise`` (torchao's
``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``, then the same
compiled autocast step); ``fmp_bf16`` (fmp.train_step "bf16-mixed", donated, fmp.compile);
``fmp_fp8_dynamic`` / ``fmp_fp8_delayed`` (fmp.float8.convert + init, TrainState float8=...,
the same fmp step); an fmp variant named with ``_eagerupd`` (``fmp_bf16_eagerupd``,
``fmp_fp8_dynamic_eagerupd``, ...) is built with ``fmp.compile(update="eager")``: the loss
compiled, the update phase torch's fused in-place AdamW; ``fmp_fp8_best_graph``: the fastest
fmp float8 variant that ran, again under fmp.cuda_graph (resolved after those ran, reported
under its own name, e.g. ``fmp_fp8_delayed_eagerupd_graph``). The tied lm head (``head``,
which shares the embedding's weight) stays in bf16 in every float8 variant (torchtitan's
filter leaves the output projection out as well); every block linear (qkv, proj, fc, out)
is converted.

Per variant: median step time over the steps after ``--warmup`` (CUDA events recorded
back to back, no sync between steps), tokens/s, peak memory (its own process), the loss
after the run (mean of the last 10 steps) and the loss every 10 steps. Ratios (see
:func:`ratios`) and a table; one JSON. Variants that cannot run here (torchao not
installed, no ``fmp.float8`` yet, no CUDA for the graph) are reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models
from memory_peak import live_at_peak

import fmp

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["amp_bf16", "torchao_tensorwise", "torchao_rowwise", "fmp_fp8_dynamic",
            "fmp_fp8_delayed", "fmp_fp8_dynamic_eagerupd", "fmp_fp8_best_graph", "fmp_bf16",
            "fmp_bf16_eagerupd"]
TORCHAO = ("torchao_tensorwise", "torchao_rowwise")
EAGER_UPD = "_eagerupd"  # fmp.compile(update="eager"): the loss compiled, torch's fused update
FMP_FP8 = tuple(f"fmp_fp8_{r}{u}{g}" for r in ("dynamic", "delayed") for u in ("", EAGER_UPD)
                for g in ("", "_graph"))
FMP_BF16 = ("fmp_bf16", "fmp_bf16" + EAGER_UPD)
LOSS_TAIL = 10
BETAS, WD = (0.9, 0.95), 0.1
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> loss (no sync)


# --------------------------------------------------------------------------- shared pieces
def markov_batches(vocab: int, seq: int, batch: int, n: int, seed: int = 0,
                   branching: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches ``(x, y)`` of a fixed random Markov chain: learnable, the same everywhere.

    Each token has ``branching`` successors drawn once from ``seed``; every row starts at a
    random token and walks the chain, so the best possible loss is about ln(branching).

    Returns:
        A list of ``n`` pairs of contiguous int64 CPU tensors of shape ``(batch, seq)``.

    Example:
        >>> (x, y), = markov_batches(16, 8, 2, 1)
        >>> bool((x[:, 1:] == y[:, :-1]).all())
        True
    """
    if min(vocab, seq, batch, n, branching) < 1:
        raise ValueError(f"markov_batches: vocab, seq, batch, n and branching must be >= 1, "
                         f"got {vocab}, {seq}, {batch}, {n}, {branching}")
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branching), generator=g)
    rows = n * batch
    tok = torch.empty(rows, seq + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    choice = torch.randint(0, branching, (rows, seq), generator=g)
    for t in range(seq):
        tok[:, t + 1] = succ[tok[:, t], choice[:, t]]
    tok = tok.view(n, batch, seq + 1)
    return [(tok[i, :, :-1].contiguous(), tok[i, :, 1:].contiguous()) for i in range(n)]


def lr_factor(count: Any, steps: int, warmup_frac: float = 0.1,
              min_frac: float = 0.1) -> torch.Tensor:
    """Linear warm-up over ``warmup_frac`` of ``steps``, then cosine down to ``min_frac``.

    ``count`` is the number of updates applied before this one (an int or a 0-d tensor);
    the result is a 0-d float32 tensor (no host sync, so it traces under torch.compile).

    Example:
        >>> float(lr_factor(9, 100)), round(float(lr_factor(99, 100)), 3)
        (1.0, 0.1)
    """
    c = torch.as_tensor(count).to(torch.float32)
    w = max(1.0, warmup_frac * steps)
    warm = torch.clamp((c + 1) / w, max=1.0)
    prog = torch.clamp((c + 1 - w) / max(1.0, steps - w), min=0.0, max=1.0)
    return warm * (min_frac + (1 - min_frac) * 0.5 * (1 + torch.cos(math.pi * prog)))


def run_steps(step: Step, batches: list, steps: int, warmup: int, device: str,
              loss_tail: int = LOSS_TAIL) -> dict[str, Any]:
    """Run ``steps`` training steps cycling over ``batches``; time those after ``warmup``.

    On CUDA an event is recorded before every timed step and after the last (no sync in
    between): one step's time is the gap between two events. On the CPU, perf_counter.

    Returns:
        ``ms`` (median), ``ms_min``, ``ms_max``, ``loss`` (mean of the last ``loss_tail``
        steps), ``losses`` (every step's loss), ``warmup_s`` (wall time of the untimed
        steps, compiles included) and ``timed_s``.
    """
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must be > warmup ({warmup}): nothing to time")
    cuda = device == "cuda"
    losses, marks = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
        if i >= warmup:
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append(time.perf_counter())
        x, y = batches[i % len(batches)]
        losses.append(step(x, y))
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append(e)
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    else:
        marks.append(time.perf_counter())
        ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    t2 = time.perf_counter()
    vals = torch.stack([x.detach().float().reshape(()).cpu() for x in losses]).tolist()
    tail = vals[-loss_tail:]
    return {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
            "loss": sum(tail) / len(tail), "losses": vals, "warmup_s": t1 - t0,
            "timed_s": t2 - t1}


def rel_diff(a: float | None, b: float | None) -> float | None:
    """``|a - b| / |b|`` (None when either is missing or b is 0)."""
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / abs(b)


def run_isolated(variant: str, script: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run ``script argv --child variant`` in a fresh process; its result dict.

    The child writes its result to a temporary JSON file; a crash, a non-zero exit or a
    timeout (the child's process group is killed) becomes ``{"error": ...}``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, script, *argv, "--child", variant, "--child-out", str(out)]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
        if out.exists():
            r = json.loads(out.read_text())
        else:
            r = {"error": f"child exited with code {rc} and wrote no result"}
        r["wall_s"] = time.perf_counter() - t0
        return r


def common_args(ap: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed first steps")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--data-batches", type=int, default=32, help="distinct batches, cycled")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--no-compile", action="store_true", help="eager steps (CPU smoke test)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the variants in this process (only with --no-compile)")
    ap.add_argument("--budget-s", type=float, default=470.0,
                    help="wall-time budget of the whole run: variants that no longer fit "
                    "are skipped, and a child's timeout is what is left")
    ap.add_argument("--json", default=None, help="result file (default benchmarks/results/)")
    ap.add_argument("--machine", default=os.environ.get("FMP_MACHINE", platform.node()))
    ap.add_argument("--memory-sites", action="store_true",
                    help="(CUDA) list what is live at each variant's memory peak, by "
                    "allocation site (slow: time few steps)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 2 or args.warmup < 1 or args.warmup >= args.steps:
        ap.error(f"--steps must be >= 2 and 1 <= --warmup < --steps, got --steps "
                 f"{args.steps}, --warmup {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.in_process and not args.no_compile:
        ap.error("--in-process needs --no-compile (compiled variants need their own process)")


def child_entry(args: argparse.Namespace, run_one: Callable[[str, Any], dict]) -> None:
    """The child side of :func:`run_isolated`: run one variant, write its result file."""
    try:
        r = run_one(args.child, args)
    except Exception as e:  # reported in the table, not fatal to the other variants
        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    Path(args.child_out).write_text(json.dumps(r))


def out_path(args: argparse.Namespace, name: str, date: str) -> Path:
    if args.json:
        return Path(args.json)
    return ROOT / "benchmarks" / "results" / f"{args.machine}-{date}-{name}.json"


def meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    ao = importlib.util.find_spec("torchao")
    ver = None
    if ao is not None:
        from importlib.metadata import version

        ver = version("torchao")
    return {"date": _dt.date.today().isoformat(), "machine": args.machine,
            "device": torch.cuda.get_device_name() if args.device == "cuda"
            else platform.processor(), "torch": torch.__version__, "torchao": ver,
            "fmp_float8": hasattr(fmp, "float8"), "argv": argv}


# --------------------------------------------------------------------------- the variants
def gpt_config(args: argparse.Namespace) -> models.GPTConfig:
    if args.tiny:
        return models.GPTConfig.tiny()
    return models.GPTConfig(seq=args.seq, n_layer=args.n_layer, n_head=args.n_head, d=args.d)


def not_head(name: str) -> bool:
    """Which linears become float8: all but the tied lm head."""
    return name != "head"


def count_float8(model: torch.nn.Module) -> int:
    return sum("Float8" in type(m).__name__ for m in model.modules())


def build_torch(model: torch.nn.Module, variant: str, args, lr: float) -> Step:
    """torch.amp bf16 (optionally after torchao's float8 conversion), model + loss compiled."""
    if variant in TORCHAO:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        cfg = Float8LinearConfig.from_recipe_name(variant.removeprefix("torchao_"))
        if args.device != "cuda":  # torchao's own emulation: the float8 casts without the
            cfg = dataclasses.replace(cfg, emulate=True)  # H100-only kernels
        convert_to_float8_training(model, config=cfg,
                                   module_filter_fn=lambda m, fqn: not_head(fqn))
    cuda = args.device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WD,
                            **({"fused": True} if cuda else {"foreach": True}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(lr_factor(s, args.steps)))

    def fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return models.gpt_loss(model(a), b)

    if not args.no_compile:
        fwd = torch.compile(fwd)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    return step


def build_fmp(model: torch.nn.Module, variant: str, args, lr: float,
              example: tuple[torch.Tensor, torch.Tensor]) -> Step:
    """fmp.train_step "bf16-mixed", donated, fmp.compile; float8 and cuda_graph by name."""
    f8 = None
    if "fp8" in variant:
        recipe = "delayed" if "delayed" in variant else "dynamic"
        fmp.float8.convert(model, recipe, modules=lambda name, m: not_head(name))
    apply_fn, params, buffers = fmp.functional(model)
    if buffers:
        raise ValueError(f"build_fmp: the GPT was expected without buffers, got "
                         f"{sorted(buffers)}")
    if "fp8" in variant:
        f8 = fmp.float8.init(model)

    def loss_fn(p: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return models.gpt_loss(apply_fn(p, a), b)

    opt = fmp.optim.adamw(lambda c: lr * lr_factor(c, args.steps), betas=BETAS,
                          weight_decay=WD)
    step_fn = fmp.train_step(loss_fn, opt, "bf16-mixed", donate=True)
    if not args.no_compile:
        step_fn = fmp.compile(step_fn, update="eager" if EAGER_UPD in variant else "compiled")
    extra = {"float8": f8} if f8 is not None else {}
    # donate=True: the step writes into the module's tensors (no second copy of the params)
    holder = {"state": fmp.TrainState.create(params, opt, None, donate=True, **extra)}
    if variant.endswith("_graph"):
        if args.device != "cuda":
            raise ValueError(f"{variant}: fmp.cuda_graph needs --device cuda")
        graphed = fmp.cuda_graph(step_fn, holder["state"], *example, warmup=3)

        def gstep(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            holder["state"], m = graphed(holder["state"], x, y)
            return m["loss"].clone()  # the graph's output is overwritten by the next replay

        return gstep

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        holder["state"], m = step_fn(holder["state"], x, y)
        return m["loss"]

    return step


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build the GPT and one variant's step, train, and measure (in this process)."""
    torch.manual_seed(0)
    c = gpt_config(args)
    batch = args.batch or (2 if args.tiny else 8)
    lr = args.lr or 3e-4
    sites = (live_at_peak(top=16) if args.memory_sites and args.device == "cuda"
             else contextlib.nullcontext({}))
    with sites as where:
        r = _build_and_run(variant, args, c, batch, lr)
    if where:
        r["memory_sites"] = where
    return r


def _build_and_run(variant: str, args: argparse.Namespace, c: models.GPTConfig, batch: int,
                   lr: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = models.GPT(c)
    batches = [(x.to(args.device), y.to(args.device))
               for x, y in markov_batches(c.vocab, c.seq, batch, args.data_batches)]
    if variant.startswith("fmp"):
        step = build_fmp(model, variant, args, lr, batches[0])
    else:
        step = build_torch(model, variant, args, lr)
    n_f8 = count_float8(model)
    setup_s = time.perf_counter() - t0
    r = run_steps(step, batches, args.steps, args.warmup, args.device)
    r["losses"] = r["losses"][::10] + ([] if (len(r["losses"]) - 1) % 10 == 0
                                       else r["losses"][-1:])
    tokens = batch * c.seq
    r.update({"tokens_per_step": tokens, "tokens_per_s": tokens / (r["ms"] * 1e-3),
              "float8_linears": n_f8, "setup_s": setup_s, "compiled": not args.no_compile,
              "params": sum(p.numel() for p in model.parameters())})
    if args.device == "cuda":
        r["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        r["between_steps_gb"] = torch.cuda.memory_allocated() / 1e9
    return r


# --------------------------------------------------------------------------- ratios
def ratios(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """fmp's best float8 step against torchao's best and torch.amp bf16.

    ``fmp_fp8_vs_torchao_float8``: best torchao ms / best fmp float8 ms (> 1: fmp faster);
    ``fmp_fp8_vs_torch_amp_bf16``: amp_bf16 ms / best fmp float8 ms;
    ``fmp_fp8_loss_vs_bf16``: |loss(best fmp float8) - loss(amp_bf16)| / loss(amp_bf16),
    the losses being each run's mean over its last 10 steps. Also which variants were the
    best, torchao's own speed-up over amp_bf16, and every float8 variant's loss difference.
    """
    def ms(v: str) -> float | None:
        r = res.get(v) or {}
        return r.get("ms") if "error" not in r else None

    def best(names) -> str | None:
        ok = [v for v in names if ms(v)]
        return min(ok, key=ms) if ok else None

    out: dict[str, Any] = {}
    f, t, a, b = best(FMP_FP8), best(TORCHAO), ms("amp_bf16"), best(FMP_BF16)
    if f and t:
        out["fmp_fp8_vs_torchao_float8"] = ms(t) / ms(f)
    if f and a:
        out["fmp_fp8_vs_torch_amp_bf16"] = a / ms(f)
        out["fmp_fp8_loss_vs_bf16"] = rel_diff(res[f]["loss"], res["amp_bf16"]["loss"])
    if t and a:
        out["torchao_float8_vs_torch_amp_bf16"] = a / ms(t)
    if a and b:
        out["fmp_bf16_vs_torch_amp_bf16"] = a / ms(b)
    out["fmp_fp8_variant"], out["torchao_float8_variant"] = f, t
    out["fmp_bf16_variant"] = b
    if a:
        out["loss_vs_bf16"] = {v: rel_diff(res[v]["loss"], res["amp_bf16"]["loss"])
                               for v in res if v != "amp_bf16" and ms(v)}
    return {k: v for k, v in out.items() if v is not None}


def print_table(out: dict[str, Any]) -> None:
    print(f"\n{out['device']}  torch {out['torch']}  torchao {out['torchao']}  "
          f"{out['config']}")
    print(f"{'variant':<24}{'ms':>9}{'tok/s':>11}{'GB':>7}{'loss':>9}{'f8 lin':>7}"
          f"{'wall s':>8}")
    for v, r in out["results"].items():
        if "error" in r:
            print(f"{v:<24} {'SKIPPED' if r.get('skipped') else 'ERROR'} {r['error'][:90]}")
            continue
        gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "-"
        print(f"{v:<24}{r['ms']:>9.2f}{r['tokens_per_s']:>11.0f}{gb:>7}{r['loss']:>9.4f}"
              f"{r['float8_linears']:>7}{r.get('wall_s', 0):>8.0f}")
    print("ratios: " + json.dumps(out["ratios"], indent=1))


# --------------------------------------------------------------------------- main
def estimate_s(args: argparse.Namespace, variant: str) -> float:
    """A rough wall time for one variant on an H200 (printed, and used by the budget)."""
    if args.device != "cuda":
        return 10.0
    c = gpt_config(args)
    n = 12 * c.n_layer * c.d**2 + c.vocab * c.d
    tokens = (args.batch or 8) * c.seq
    flops = tokens * (6 * n + 12 * c.n_layer * c.d * c.seq)
    ms = flops / 400e12 * 1e3 / (1.35 if "fp8" in variant or "torchao" in variant else 1.0)
    compile_s = 0 if args.no_compile else 2.5 * c.n_layer + 15
    return 15 + compile_s + args.steps * ms / 1e3


def skip_reason(variant: str, args: argparse.Namespace) -> str | None:
    if variant in TORCHAO and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    if "fp8" in variant and not hasattr(fmp, "float8"):
        return "this fmp has no fmp.float8"
    if variant.endswith("_graph") and args.device != "cuda":
        return "fmp.cuda_graph needs CUDA"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, steps=200, warmup=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.child:
        return child_entry(args, run_variant)
    names = [v for v in args.variants.split(",") if v]
    known = list(dict.fromkeys(VARIANTS + list(FMP_FP8) + list(FMP_BF16)))
    bad = [v for v in names if v not in known]
    if bad:
        ap.error(f"unknown variants {bad}; accepted: {known}")
    c = gpt_config(args)
    est = {v: estimate_s(args, v) for v in names}
    print(f"float8 bench: {c}, batch {args.batch or (2 if args.tiny else 8)}, "
          f"{args.steps} steps; estimated wall " + ", ".join(f"{v} ~{s:.0f}s"
                                                            for v, s in est.items())
          + f"; total ~{sum(est.values()):.0f}s (budget {args.budget_s:.0f}s)", flush=True)
    t_start = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    for v in names:
        if v == "fmp_fp8_best_graph":
            base = min((u for u in FMP_FP8 if not u.endswith("_graph")
                        and "ms" in res.get(u, {})), key=lambda u: res[u]["ms"], default=None)
            v = f"{base}_graph" if base else v
        why = skip_reason(v, args)
        left = args.budget_s - (time.perf_counter() - t_start)
        if why is None and v == "fmp_fp8_best_graph":
            why = "no fmp float8 variant ran before it"
        if why is None and left < 0.6 * est.get(v, est.get("fmp_fp8_best_graph", 0)):
            why = f"budget: {left:.0f} s left of {args.budget_s:.0f}"
        if why:
            res[v] = {"error": why, "skipped": True}
        elif args.in_process:
            try:
                res[v] = run_variant(v, args)
            except Exception as e:
                traceback.print_exc()
                res[v] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        else:
            res[v] = run_isolated(v, __file__, argv, left)
        r = res[v]
        print(f"[float8] {v}: " + (r["error"] if "error" in r else
              f"{r['ms']:.2f} ms  {r['tokens_per_s']:.0f} tok/s  loss {r['loss']:.4f}  "
              f"wall {r.get('wall_s', 0):.0f} s"), flush=True)
        ms = r.get("memory_sites") or {}
        if ms:
            print(f"  peak {ms['peak_gb']:.2f} GB (allocated in the run); between steps "
                  f"{r.get('between_steps_gb', 0):.2f} GB; live at the peak:")
            for site in ms["sites"]:
                print(f"  {site['gb']:7.3f} GB {site['n']:5d}  {site['where']}")
    out = {**meta(args, argv), "config": {**c.__dict__, "batch": args.batch or
                                          (2 if args.tiny else 8), "steps": args.steps,
                                          "warmup": args.warmup, "lr": args.lr or 3e-4,
                                          "float8_excluded": ["head"]},
           "results": res, "ratios": ratios(res), "wall_s": time.perf_counter() - t_start}
    print_table(out)
    path = out_path(args, "float8", out["date"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
