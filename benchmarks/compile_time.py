"""Where a cold build of a compiled train step spends its time (issue 18's compile target).

    python benchmarks/compile_time.py --variants amp_graph_fp16,fmp_fp16_graph
    python benchmarks/compile_time.py --variants fmp_fp16_graph:nocombo --tiny --device cpu

Each variant (a ``train_step.py`` GPT variant, optionally with ``:option`` suffixes) is built
in its own process with empty inductor and Triton caches, so every figure is a cold compile.
Per variant: the wall clock of the build (compile, warm-up steps and, for graphed variants,
the capture), dynamo's per-frame compile times (``get_compilation_metrics``: which graph,
dynamo tracing against the backend) and the aggregate of torch's compile timers
(``torch._dynamo.utils.compile_times``: AOTAutograd, inductor's lowering, scheduling,
codegen, the wait for the Triton workers, the backward's compile). Options:
``nocombo`` turns off the combo kernels fmp's two-graph step asks for (``STEP_OPTIONS``).
Writes the results as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: the compile timers reported (the rest of compile_times' keys are sub-steps of these)
TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.fw_compiler_base",
          "compile_fx.<locals>.bw_compiler", "GraphLowering.run", "Scheduler.__init__",
          "Scheduler.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path",
          "min_cut_rematerialization_partition", "create_aot_dispatcher_function",
          "build_guards")


def child(spec: str, device: str, tiny: bool) -> dict[str, Any]:
    """Build one variant in this process and say where the time went."""
    import torch

    sys.path.insert(0, str(HERE))
    import train_step

    import fmp._compile

    variant, *opts = spec.split(":")
    if "nocombo" in opts:
        fmp._compile.STEP_OPTIONS.clear()
    t0 = time.perf_counter()
    step, _info = train_step.build("gpt", variant, device, tiny)
    loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    frames = []
    for m in torch._dynamo.utils.get_compilation_metrics():
        if getattr(m, "co_name", None) is None:
            continue
        frames.append({k: getattr(m, k, None) for k in (
            "co_name", "entire_frame_compile_time_s", "backend_compile_time_s",
            "inductor_compile_time_s", "code_gen_time_s", "graph_op_count", "guard_count")})
    times = {}
    # "name, seconds" lines (torch 2.13) or an aligned "name   seconds" table (2.11)
    for line in torch._dynamo.utils.compile_times(repr="str", aggregate=True).splitlines():
        parts = line.rsplit(None, 1)
        try:
            times[parts[0].rstrip(", ")] = float(parts[1])
        except (IndexError, ValueError):
            continue
    return {"variant": spec, "fmp": fmp._compile.__file__, "build_s": build_s,
            "loss": float(loss), "frames": frames,
            "timers": {k: times[k] for k in TIMERS if k in times}, "all_timers": times}


def run(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """``spec`` built in a fresh process with empty caches."""
    with tempfile.TemporaryDirectory(prefix="fmp-ct-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, __file__, "--child", spec, "--child-json", out,
               "--device", args.device] + (["--tiny"] if args.tiny else [])
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"variant": spec, "error": f"ran past --timeout {args.timeout} s"}
        if proc.returncode != 0 or not os.path.exists(out):
            return {"variant": spec, "error": f"exit {proc.returncode}"}
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="amp_graph_fp16,fmp_fp16_graph")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json")
    ap.add_argument("--child")
    ap.add_argument("--child-json")
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child_json).write_text(json.dumps(child(args.child, args.device, args.tiny)))
        return []
    res = []
    for spec in args.variants.split(","):
        r = run(spec, args)
        res.append(r)
        if "error" in r:
            print(f"{spec}: {r['error']}", flush=True)
            continue
        print(f"{spec}: build {r['build_s']:.1f} s, loss {r['loss']:.4f} ({r['fmp']})",
              flush=True)
        for f in r["frames"]:
            print(f"   frame {f['co_name']}: {f['entire_frame_compile_time_s']} s "
                  f"(backend {f['backend_compile_time_s']} s, {f['graph_op_count']} ops)")
        for k, v in r["timers"].items():
            print(f"   {k}: {v:.2f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
