"""Host work of one eager donated fmp step: how many times it walks the state's trees.

A walk is one optree call over a tree (flatten, leaves, map, ...) or one Python loop over
its leaves (a ``for`` line in fmp's sources that runs once per leaf). On a model of a few
hundred tensors each costs tens of microseconds of host time: the eager step's overhead
against torch.amp. Prints, per model (a small ResNet with BatchNorm, and an MLP), the
walks of one step by the fmp function that makes them, and the step's host time.

    PYTHONPATH=. python benchmarks/host_walks.py [--json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import linecache
import sys
import time
from pathlib import Path
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn

import fmp

FMP_DIR = str(Path(fmp.__file__).parent)
WALKERS = ("tree_flatten", "tree_flatten_with_path", "tree_flatten_with_accessor",
           "tree_leaves", "tree_map", "tree_map_", "tree_structure", "tree_paths",
           "tree_unflatten")


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def resnet_ish(blocks: int = 8, c: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                         nn.ReLU(), *(_Block(c) for _ in range(blocks)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def mlp(layers: int = 16, d: int = 32) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(d, d), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(d, 10))


def _setup(name: str) -> tuple[Any, Any, tuple[Any, ...], int]:
    torch.manual_seed(0)
    net = resnet_ish() if name == "resnet" else mlp()
    apply_fn, params, buffers = fmp.functional(net)
    opt = fmp.optim.adamw(1e-3)
    has_state = bool(buffers)

    if has_state:
        def loss_fn(p, ms, x, y):
            out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
            return F.cross_entropy(out.float(), y), new_ms
        x = torch.randn(4, 3, 8, 8)
    else:
        def loss_fn(p, x, y):
            return F.cross_entropy(apply_fn(p, x).float(), y)
        x = torch.randn(4, 32)
    y = torch.randint(0, 10, (4,))
    step = fmp.train_step(loss_fn, opt, "bf16-mixed", donate=True, has_state=has_state)
    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(),
                                  model_state=dict(buffers) if has_state else None)
    return step, state, (x, y), len(params)


class _Counter:
    """Counts optree calls (by the fmp function making them) and fmp ``for`` lines' runs."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[tuple[str, int]] = collections.Counter()
        self._orig: dict[str, Any] = {}

    def _caller(self) -> str:
        f = sys._getframe(2)
        while f is not None and not f.f_code.co_filename.startswith(FMP_DIR):
            f = f.f_back
        if f is None:
            return "<outside fmp>"
        return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*a: Any, **k: Any) -> Any:
            self.calls[f"{self._caller()} optree.{name}"] += 1
            return fn(*a, **k)

        return counted

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(FMP_DIR):
            return None
        if event == "line":
            self.lines[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return self._trace

    def __enter__(self) -> _Counter:
        for n in WALKERS:
            if hasattr(optree, n):
                self._orig[n] = getattr(optree, n)
                setattr(optree, n, self._wrap(n, self._orig[n]))
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(None)
        for n, fn in self._orig.items():
            setattr(optree, n, fn)

    def loops(self, n_leaves: int) -> collections.Counter[str]:
        """Python passes over the leaves: ``for`` lines run at least once per leaf."""
        out: collections.Counter[str] = collections.Counter()
        for (path, lineno), count in self.lines.items():
            src = linecache.getline(path, lineno).strip()
            if count >= n_leaves and (src.startswith("for ") or " for " in src):
                out[f"{Path(path).name}:{lineno} {src[:60]}"] += count // n_leaves
        return out


def measure(name: str, steps: int = 20) -> dict[str, Any]:
    step, state, batch, n = _setup(name)
    for _ in range(3):
        state, _ = step(state, *batch)
    with _Counter() as c:
        state, _ = step(state, *batch)
    loops = c.loops(n)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, _ = step(state, *batch)
        times.append(time.perf_counter() - t0)
    walks = sum(v for k, v in c.calls.items() if not k.endswith("tree_unflatten"))
    return {"model": name, "params": n, "optree_walks": walks,
            "optree_unflatten": sum(v for k, v in c.calls.items()
                                    if k.endswith("tree_unflatten")),
            "python_leaf_loops": sum(loops.values()),
            "ms_per_step": 1e3 * sorted(times)[len(times) // 2],
            "by_caller": dict(c.calls.most_common()), "loops": dict(loops.most_common())}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    out = [measure(m) for m in ("resnet", "mlp")]
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    for r in out:
        print(f"{r['model']}: {r['params']} params; per eager donated step: "
              f"{r['optree_walks']} optree walks (+{r['optree_unflatten']} unflatten), "
              f"{r['python_leaf_loops']} Python loops over the leaves; "
              f"{r['ms_per_step']:.2f} ms (CPU, tiny shapes)")
        for k, v in r["by_caller"].items():
            print(f"    {v:3d}  {k}")
        for k, v in r["loops"].items():
            print(f"    {v:3d}  loop {k}")
    return out


if __name__ == "__main__":
    main()
