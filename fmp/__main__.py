"""``python -m fmp``: train a small network under a few policies and print what happened.

With the ``demo`` extra installed this is ``python -m fmp.demo`` (the digits demo, same
flags); without it, a self-contained run on synthetic data.
"""

from __future__ import annotations

import importlib.util
import sys
import time


def _tiny() -> None:
    import torch
    import torch.nn.functional as F

    import fmp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (512,), generator=g)
    x = (torch.randn(4, 16, generator=g) * 2)[y] + torch.randn(512, 16, generator=g)
    x, y = x.to(device), y.to(device)
    print(f"device={device}  torch={torch.__version__}")
    print(f"{'policy':<12} {'first loss':>10} {'last loss':>10} {'skipped':>8} "
          f"{'scale':>8} {'steps/s':>8}")
    for name in ("fp32", "bf16-mixed", "fp16-mixed"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                  torch.nn.Linear(64, 4)).to(device)
        apply_fn, params, _ = fmp.functional(net)
        opt = fmp.optim.adamw(1e-2)
        scale = fmp.DynamicLossScale.create() if "fp16" in name else None
        def loss_fn(p, a, b, apply_fn=apply_fn):
            return F.cross_entropy(apply_fn(p, a).float(), b)

        step = fmp.train_step(loss_fn, opt, name)
        state = fmp.TrainState.create(params, opt, scale)
        t0 = time.perf_counter()
        first = None
        for _ in range(50):
            state, m = step(state, x, y)
            first = float(m["loss"]) if first is None else first
        rate = 50 / (time.perf_counter() - t0)
        print(f"{name:<12} {first:>10.4f} {float(m['loss']):>10.4f} "
              f"{int(m['skipped_total']):>8d} {float(m['loss_scale']):>8.0f} {rate:>8.1f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("sklearn") is not None:
        from fmp.demo import main as demo_main

        sys.exit(demo_main(argv))
    _tiny()


if __name__ == "__main__":
    main()
