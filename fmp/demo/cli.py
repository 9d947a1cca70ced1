"""The demo's command line: ``python -m fmp.demo [--steps N] [--policies a,b] ...``."""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from pathlib import Path

import torch

import fmp
from fmp.demo.data import load_digits_split
from fmp.demo.report import format_table, save_curves, save_json
from fmp.demo.run import APEX_LEVELS, DemoConfig, RunResult, apex_available, run_policy

__all__ = ["DEFAULT_POLICIES", "build_parser", "main", "parse_args"]

#: The policies of a plain ``python -m fmp.demo``.
DEFAULT_POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "O1", "O2")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(","))
    if not text.strip() or any(not n for n in names):
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of policy names without empty entries, got "
            f"{text!r}")
    for name in names:
        if name.upper() in APEX_LEVELS:
            continue
        if "=" in name:
            raise argparse.ArgumentTypeError(
                f"{name!r}: key=dtype specs cannot be listed here (their commas separate "
                f"policies); use a preset such as fp32, bf16-mixed, fp16-mixed, bf16-true")
        base, plus, write = name.partition("+")
        if plus and write not in fmp.optim.BF16_UPDATES:
            raise argparse.ArgumentTypeError(
                f"{name!r}: unknown bf16 update {write!r} after '+'; accepted: "
                f"{', '.join(fmp.optim.BF16_UPDATES)} (e.g. bf16-true+kahan)")
        try:
            fmp.get_policy(base)
        except ValueError:
            presets = ", ".join(k for k in fmp.PRESETS if not k.startswith("o"))
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; accepted: fmp presets ({presets}), dtype names, "
                f"or Apex opt levels ({', '.join(APEX_LEVELS)}, run through adapters.apex)"
            ) from None
    if len({n.lower() for n in names}) != len(names):
        raise argparse.ArgumentTypeError(f"a policy is listed twice in {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser.

    Returns:
        An :class:`argparse.ArgumentParser` (``prog="python -m fmp.demo"``).
    """
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m fmp.demo",
        description="Train a small CNN on scikit-learn's handwritten digits under several "
                    "mixed-precision policies, side by side: fmp's functional train step "
                    "(fp32, bf16-mixed, fp16-mixed) and Apex-style O1/O2 loops through "
                    "adapters.apex. Prints a table and writes curves.png and results.json.",
    )
    p.add_argument("--steps", type=_positive_int, default=d.steps,
                   help="optimizer steps per policy (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help="images per step, at most the 1,437 training images (default: "
                        "%(default)s)")
    p.add_argument("--policies", type=_policies, default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policies: fmp presets (fp32, bf16-mixed, "
                        "fp16-mixed, bf16-true, ...), bf16-true+kahan / bf16-true+stochastic "
                        "(bf16 params, no float32 masters, bf16 moments) or Apex opt levels "
                        "O0-O5 run through adapters.apex (default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=d.seed,
                   help="seed of the split, the initial weights and the batch order "
                        "(default: %(default)s)")
    p.add_argument("--lr", type=_positive_float, default=d.lr,
                   help="peak AdamW learning rate, cosine decay to 0 (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where to train; auto: cuda when available (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("out/demo"), metavar="DIR",
                   help="folder for curves.png and results.json, created (default: "
                        "%(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="compile fmp's train step with fmp.compile (slow start on CPU)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[DemoConfig, Path]:
    """Parse the command line into a configuration and an output folder.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        ``(config, out_dir)``.

    Raises:
        SystemExit: code 2 with argparse's message naming the flag, for a bad flag or
            ``--device cuda`` without a GPU.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda was asked for but torch.cuda.is_available() "
                     "is False (use --device cpu or auto)")
    if ns.batch_size > 1437:
        parser.error(f"argument --batch-size: at most 1437 (the training images), got "
                     f"{ns.batch_size}")
    cfg = DemoConfig(policies=ns.policies, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr,
                     seed=ns.seed, device=device, compile=ns.compile, progress=ns.progress)
    return cfg, ns.out


def missing_extras() -> list[str]:
    """The packages of the ``demo`` extra that are not installed.

    Returns:
        Distribution names (``scikit-learn``, ``matplotlib``, ``tqdm``), empty when all are.
    """
    wanted = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}
    return [dist for mod, dist in wanted.items() if importlib.util.find_spec(mod) is None]


def main(argv: list[str] | None = None) -> int:
    """Run the demo: train every policy, print the table, write the figure and JSON.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); see ``--help``.

    Returns:
        0 on success (an unavailable Apex level is reported, not an error); 1 when a
        package of the ``demo`` extra is missing (the message says which).

    Raises:
        SystemExit: code 2 for bad flags (argparse).

    Example:
        >>> main(["--steps", "20", "--policies", "fp32", "--out", "/tmp/d"])  # doctest: +SKIP
    """
    cfg, out = parse_args(argv)
    missing = missing_extras()
    if missing:
        print(f"python -m fmp.demo needs the 'demo' extra (missing: {', '.join(missing)}): "
              f"pip install -e '.[demo]'", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    data = load_digits_split(cfg.seed, device=cfg.device)
    print(f"fmp {fmp.__version__} demo: digits {len(data.y_train)} train / "
          f"{len(data.y_test)} test, {cfg.steps} steps of {cfg.batch_size}, "
          f"device={cfg.device}, torch={torch.__version__}", flush=True)
    if any(p.upper() in APEX_LEVELS for p in cfg.policies) and apex_available():
        print(f"note: the Apex rows are skipped: {apex_available()}", flush=True)
    results: list[RunResult] = [run_policy(name, data, cfg) for name in cfg.policies]
    wall = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    curves = save_curves(results, out / "curves.png")
    extra = {"wall_s": wall, "torch": torch.__version__, "fmp": fmp.__version__,
             "python": platform.python_version(), "threads": torch.get_num_threads(),
             "n_train": len(data.y_train), "n_test": len(data.y_test)}
    js = save_json(results, cfg, out / "results.json", extra)
    print()
    print(format_table(results))
    print(f"\nwall time {wall:.1f} s; wrote {curves} and {js}", flush=True)
    return 0

