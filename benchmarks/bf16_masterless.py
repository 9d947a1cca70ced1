"""bf16 without float32 masters (issue 19): convergence and state bytes next to bf16-mixed.

    python benchmarks/bf16_masterless.py --json /tmp/out/bf16.json        # CUDA (an H200)
    python benchmarks/bf16_masterless.py --tiny --device cpu --steps 3 --no-compile --json x.json

GPT-2 small (benchmarks/models.py's GPTConfig default: 124M params, seq 1024), batch 16,
``--steps`` steps (500) on the synthetic Markov-chain data of benchmarks/float8.py (the same
batches in the same order for every variant), AdamW (lr 6e-4, betas 0.9/0.95, weight decay
0.1, warm-up over 10% of the steps, cosine to 10%), each variant in its own process and
compiled with fmp.compile (a variant whose compile fails, or that is still running after
``--compile-timeout-s``, is rerun eagerly and says so in ``compile_error``):

- ``bf16_mixed``: float32 params (the masters) and float32 moments, compute in bf16;
- ``bf16_true_kahan``: params in bf16 (policy "bf16-true"), bf16 moments,
  ``fmp.optim.adamw(..., state_dtype="bf16", bf16_update="kahan")`` (a bf16 compensation
  buffer per param);
- ``bf16_true_stochastic``: the same with ``bf16_update="stochastic"``;
- ``bf16_true_plain``: the same without compensation, the counter-example: updates smaller
  than half a bf16 step of the weight are lost, and late in the schedule most are.

Per variant: the loss every 25 steps, the final loss (mean of the last 20 steps), its
relative difference to bf16_mixed's, ``fmp.optim.state_bytes_per_param(params, opt_state,
grads=True)`` (params + optimizer state + one grad per param), the bytes of the whole
TrainState per param (the compute copy of the mixed step included), the median step time
and the measured peak memory. Ratio ``bf16_kahan_state_bytes_per_param``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import float8 as common
import models

import fmp

VARIANTS = ["bf16_mixed", "bf16_true_kahan", "bf16_true_plain", "bf16_true_stochastic"]
LOSS_TAIL, EVERY = 20, 25


def tree_bytes_per_param(tree: Any, params: Any) -> float:
    """Bytes of every tensor of ``tree`` per floating element of ``params``."""
    n = sum(x.numel() for x in optree.tree_leaves(params)
            if isinstance(x, torch.Tensor) and x.is_floating_point())
    seen, total = set(), 0
    for x in optree.tree_leaves(tree):
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            total += x.numel() * x.element_size()
    return total / n


def build(variant: str, args: argparse.Namespace, model: torch.nn.Module, lr: float):
    """``(step(x, y) -> loss, holder)`` for one variant; ``holder["state"]`` the TrainState."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; accepted: {VARIANTS}")
    mixed = variant == "bf16_mixed"
    policy = fmp.get_policy("bf16-mixed" if mixed else "bf16-true")
    apply_fn, params, _ = fmp.functional(model)
    params = policy.cast_to_param(params)
    update = None if mixed or variant == "bf16_true_plain" else variant.split("_")[-1]

    def loss_fn(p: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return models.gpt_loss(apply_fn(p, a), b)

    opt = fmp.optim.adamw(lambda c: lr * common.lr_factor(c, args.steps), betas=common.BETAS,
                          weight_decay=common.WD, state_dtype="f32" if mixed else "bf16",
                          bf16_update=update)
    step_fn = fmp.train_step(loss_fn, opt, policy, donate=True)
    holder = {"state": fmp.TrainState.create(params, opt, None), "step_fn": step_fn}
    if not args.no_compile:
        holder["step_fn"] = fmp.compile(step_fn)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        holder["state"], m = holder["step_fn"](holder["state"], x, y)
        return m["loss"]

    return step, holder


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    c = models.GPTConfig.tiny() if args.tiny else models.GPTConfig()
    batch = args.batch or (2 if args.tiny else 16)
    lr = args.lr or 6e-4
    with torch.device(args.device):
        model = models.GPT(c)
    batches = [(x.to(args.device), y.to(args.device))
               for x, y in common.markov_batches(c.vocab, c.seq, batch, args.data_batches)]
    step, holder = build(variant, args, model, lr)
    st = holder["state"]
    r: dict[str, Any] = {
        "state_bytes_per_param": fmp.optim.state_bytes_per_param(st.params, st.opt_state,
                                                                 grads=True),
        "state_bytes_per_param_no_grads": fmp.optim.state_bytes_per_param(st.params,
                                                                          st.opt_state)}
    first_error = None
    try:
        r.update(common.run_steps(step, batches, args.steps, args.warmup, args.device,
                                  LOSS_TAIL))
    except Exception as e:
        if args.no_compile:
            raise
        traceback.print_exc()  # compiled step failed: the same variant eagerly, said so
        first_error = f"{type(e).__name__}: {str(e)[:300]}"
        return run_variant(variant, argparse.Namespace(**{**vars(args), "no_compile": True})) \
            | {"compile_error": first_error}
    st = holder["state"]
    r["train_state_bytes_per_param"] = tree_bytes_per_param(st, st.params)
    losses = r.pop("losses")
    r["loss_curve"] = {i + 1: losses[i] for i in range(EVERY - 1, len(losses), EVERY)}
    r["loss_curve"].setdefault(len(losses), losses[-1])
    r["first_loss"] = losses[0]
    r.update({"tokens_per_s": batch * c.seq / (r["ms"] * 1e-3), "compiled": not args.no_compile,
              "skipped_steps": int(st.skipped_total), "param_dtype": str(
                  optree.tree_leaves(st.params)[0].dtype).removeprefix("torch.")})
    if args.device == "cuda":
        r["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return r


def ratios(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``bf16_kahan_state_bytes_per_param`` and each variant's final loss against bf16_mixed.

    ``<variant>_loss_vs_bf16_mixed`` = |loss - loss(bf16_mixed)| / loss(bf16_mixed), the
    losses being the mean of each run's last 20 steps.
    """
    out: dict[str, Any] = {}
    k = res.get("bf16_true_kahan", {})
    if "state_bytes_per_param" in k:
        out["bf16_kahan_state_bytes_per_param"] = k["state_bytes_per_param"]
    m = res.get("bf16_mixed", {})
    if "state_bytes_per_param" in m:
        out["bf16_mixed_state_bytes_per_param"] = m["state_bytes_per_param"]
    base = m.get("loss") if "error" not in m else None
    for v, r in res.items():
        if v != "bf16_mixed" and "loss" in r and "error" not in r:
            d = common.rel_diff(r["loss"], base)
            if d is not None:
                out[f"{v}_loss_vs_bf16_mixed"] = d
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"\n{out['device']}  torch {out['torch']}  {out['config']}")
    print(f"{'variant':<22}{'B/param':>8}{'state':>7}{'ms':>8}{'GB':>7}{'loss':>9}"
          f"{'vs mixed':>10}")
    for v, r in out["results"].items():
        if "error" in r:
            print(f"{v:<22} ERROR {r['error'][:90]}")
            continue
        gb = f"{r['peak_gb']:.2f}" if r.get("peak_gb") else "-"
        d = out["ratios"].get(f"{v}_loss_vs_bf16_mixed")
        print(f"{v:<22}{r['state_bytes_per_param']:>8.1f}"
              f"{r['train_state_bytes_per_param']:>7.1f}{r['ms']:>8.2f}{gb:>7}"
              f"{r['loss']:>9.4f}{'-' if d is None else f'{100 * d:.2f}%':>10}")
    curve = {v: r.get("loss_curve") for v, r in out["results"].items() if "loss_curve" in r}
    if curve:
        steps = list(next(iter(curve.values())))
        print("loss every 25 steps:\n" + f"{'step':>6}" + "".join(f"{v[-12:]:>13}" for v in curve))
        for s in steps:
            print(f"{s:>6}" + "".join(f"{c.get(s, float('nan')):>13.4f}" for c in curve.values()))
    print("ratios: " + json.dumps(out["ratios"], indent=1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.common_args(ap, steps=500, warmup=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-timeout-s", type=float, default=150.0,
                    help="a compiled variant still running after this long is stopped and "
                    "run again eagerly (the stochastic-rounding step compiled for minutes on "
                    "the dev CPU)")
    args = ap.parse_args(argv)
    common.check_args(ap, args)
    if args.child:
        return common.child_entry(args, run_variant)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; accepted: {VARIANTS}")
    est = 0.0 if args.device != "cuda" else 60 + args.steps * 0.045
    print(f"bf16 masterless bench: {args.steps} steps; estimated ~{est:.0f} s a variant, "
          f"~{est * len(names):.0f} s in all (budget {args.budget_s:.0f} s)", flush=True)
    t_start = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    for v in names:
        left = args.budget_s - (time.perf_counter() - t_start)
        if args.device == "cuda" and left < 0.6 * est:
            res[v] = {"error": f"budget: {left:.0f} s left", "skipped": True}
        elif args.in_process:
            try:
                res[v] = run_variant(v, args)
            except Exception as e:
                traceback.print_exc()
                res[v] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        else:
            cap = left if args.no_compile else min(left, args.compile_timeout_s)
            res[v] = common.run_isolated(v, __file__, argv, cap)
            if res[v].get("error", "").startswith("timeout") and not args.no_compile:
                why = f"compiled: {res[v]['error']}"
                left = args.budget_s - (time.perf_counter() - t_start)
                res[v] = common.run_isolated(v, __file__, [*argv, "--no-compile"], left)
                res[v]["compile_error"] = why
        r = res[v]
        print(f"[bf16] {v}: " + (r["error"] if "error" in r else
              f"loss {r['loss']:.4f}  {r['state_bytes_per_param']:.1f} B/param  "
              f"{r['ms']:.2f} ms"), flush=True)
    c = models.GPTConfig.tiny() if args.tiny else models.GPTConfig()
    out = {**common.meta(args, argv),
           "config": {**c.__dict__, "batch": args.batch or (2 if args.tiny else 16),
                      "steps": args.steps, "lr": args.lr or 6e-4, "loss_tail": LOSS_TAIL},
           "results": res, "ratios": ratios(res), "wall_s": time.perf_counter() - t_start}
    print_table(out)
    path = common.out_path(args, "bf16-masterless", out["date"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
