"""Host cost of Apex's O1 casts (the ``TorchFunctionMode``) against ``torch.autocast``, on CPU.

    python benchmarks/o1_host.py                 # tiny GPT-2-like + tiny ResNet, 60 steps each
    python benchmarks/o1_host.py --quick         # smoke run (a few steps)
    python benchmarks/o1_host.py --profile       # plus cProfile of the O1 steps (handler lines)

Tiny widths, CPU: the kernels take microseconds, so what is timed is mostly Python, the
part the O1 mode adds to. Per model, two train steps (forward, backward, AdamW step) on
copies of one model:

- ``amp``: ``torch.autocast("cpu", torch.bfloat16)`` around the forward, a plain loop;
- ``apex``: ``amp.initialize(model, opt, opt_level="O4")`` (bfloat16 casts on the CPU),
  ``amp.scale_loss`` and ``opt.step()``, as a legacy Apex script does.

The two are interleaved step by step (the O1 mode is installed only around the apex
step), and the median per-step time of each is printed with their ratio
(``amp/apex``: 1.0 means the O1 mode costs nothing; the target on the GPU is >= 0.98; also
the ratio of the fastest steps, steadier on a shared machine) and
the number of ``__torch_function__`` calls the mode handles per step.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "adapters")]

import models  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from resnet_tiny import TinyResNet  # noqa: E402


def _gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    c = models.GPTConfig(vocab=64, seq=16, n_layer=2, n_head=2, d=16)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, c.vocab, (2, c.seq + 1), generator=g)
    return models.GPT(c), (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), models.gpt_loss


def _resnet() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (2,), generator=g)
    return TinyResNet(width=4), (x, y), lambda out, t: F.cross_entropy(out.float(), t)


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


def _amp_step(model, batch, loss_of):
    opt = _opt(model)
    x, y = batch

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _apex_step(model, batch, loss_of):
    from adapters.apex import amp as apex_amp
    from adapters.apex.amp import _o1_install

    a = apex_amp.Amp()
    model, opt = a.initialize(model, _opt(model), opt_level="O4", verbosity=0)
    mode = _o1_install.current()
    assert mode is not None
    apex_amp.deactivate()
    x, y = batch

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with a.autocast():
            loss = loss_of(model(x), y)
        with a.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    return step, mode


def _count_calls(step, mode) -> int:
    """``__torch_function__`` calls the mode handles in one step."""
    from adapters.apex.amp import _o1_install

    cls = type(mode)
    orig = cls.__torch_function__
    n = [0]

    def counting(self, *a, **k):
        n[0] += 1
        return orig(self, *a, **k)

    cls.__torch_function__ = counting
    try:
        _o1_install.install(mode)
        step()
    finally:
        _o1_install.uninstall()
        cls.__torch_function__ = orig
    return n[0]


def _profile(step, mode, steps: int, top: int) -> str:
    from adapters.apex.amp import _o1_install

    _o1_install.install(mode)
    prof = cProfile.Profile()
    try:
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
    finally:
        _o1_install.uninstall()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def bench(name: str, build, steps: int, warmup: int, profile: bool) -> dict[str, float]:
    from adapters.apex.amp import _o1_install

    torch.manual_seed(0)
    model, batch, loss_of = build()
    amp_step = _amp_step(copy.deepcopy(model), batch, loss_of)
    apex_step, mode = _apex_step(copy.deepcopy(model), batch, loss_of)
    t_amp, t_apex = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        amp_step()
        t1 = time.perf_counter()
        _o1_install.install(mode)
        try:
            t2 = time.perf_counter()
            apex_step()
            t3 = time.perf_counter()
        finally:
            _o1_install.uninstall()
        if i >= warmup:
            t_amp.append(t1 - t0)
            t_apex.append(t3 - t2)
    calls = _count_calls(apex_step, mode)
    a, b = statistics.median(t_amp) * 1e3, statistics.median(t_apex) * 1e3
    res = {"amp_ms": a, "apex_ms": b, "ratio_amp_over_apex": a / b,
           # the fastest steps: robust to other processes on a shared machine
           "ratio_min_amp_over_apex": min(t_amp) / min(t_apex),
           "torch_function_calls_per_step": calls,
           "handler_us_per_call_upper_bound": (b - a) * 1e3 / max(calls, 1)}
    print(name, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
    if profile:
        print(_profile(apex_step, mode, max(steps // 2, 1), 25), flush=True)
    return res


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    ap.add_argument("--profile", action="store_true", help="cProfile the O1 steps")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    torch.set_num_threads(1)
    res = {name: bench(name, build, args.steps, args.warmup, args.profile)
           for name, build in (("gpt", _gpt), ("resnet", _resnet))}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
