"""The rank side of :mod:`dist_launch`: init gloo from the environment, run scenarios,
save each one's result (or its traceback) for the test process to check."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run(scenarios: dict[str, Callable[[int, int], Any]], timeout_s: float = 30.0) -> None:
    """Run ``scenarios`` (name -> fn(rank, world)) in order on this rank; save results.

    A scenario that raises records ``{"error": traceback}`` and the next one still runs;
    ``results["seconds"]`` holds each scenario's wall time.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"seconds": {}}
    for name, fn in scenarios.items():
        t = time.perf_counter()
        try:
            results[name] = fn(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results["seconds"][name] = round(time.perf_counter() - t, 2)
    torch.save(results, os.path.join(os.environ["FMP_DIST_OUT"], f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # leave without interpreter finalisation: gloo threads freeing tensors during teardown
    # can abort a rank whose work is already saved (see benchmarks/ddp_train.exit_now)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
