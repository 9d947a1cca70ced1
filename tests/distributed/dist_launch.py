"""Run a worker script on N local processes (gloo, CPU) with a hard wall-clock limit.

No torchrun: each rank is a ``python`` subprocess given ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (a free port), its output to a file so no pipe can fill.
Every rank saves its results with ``torch.save`` to ``$FMP_DIST_OUT/rank{r}.pt``; a run
that passes the limit is killed and reported with every rank's output, never left to hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _outputs(logs: list[Path]) -> str:
    return "\n".join(f"----- rank {r} -----\n{p.read_text(errors='replace')[-6000:]}"
                     for r, p in enumerate(logs))


def run_ranks(script: str, *args: str, world: int = 2, timeout: float = 60.0) -> list[Any]:
    """Run ``tests/distributed/<script>`` on ``world`` ranks; return each rank's results.

    Raises:
        AssertionError: a rank failed, or the run passed ``timeout`` seconds (all ranks
            are then killed); the message holds every rank's output.
    """
    out = Path(tempfile.mkdtemp(prefix="fmp-dist-"))
    port = str(free_port())
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        env = _env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "FMP_DIST_OUT": str(out)})
        with open(logs[r], "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args],
                                          env=env, stdout=f, stderr=subprocess.STDOUT,
                                          cwd=ROOT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        raise AssertionError(f"{script} passed its {timeout:.0f} s limit; killed.\n"
                             + _outputs(logs)) from None
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"{script}: ranks {bad} failed\n" + _outputs(logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def run_torchrun(argv: list[str], nproc: int = 2, timeout: float = 120.0
                 ) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N argv...`` with a wall-clock limit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *argv]
    return subprocess.run(cmd, env=_env({}), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
