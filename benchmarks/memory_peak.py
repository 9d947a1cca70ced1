"""What is live at a variant's memory peak, and where it was allocated.

Used by ``diagnose.py`` (CUDA only). It records the caching allocator's history while a
variant is built and run, replays the alloc/free events, and at the moment the variant's own
allocations peak it groups the live blocks by where they were allocated (the innermost
Python frame outside torch, which for compiled code is the generated code's line, shown as
its source text).
"""

from __future__ import annotations

import contextlib
import linecache
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

_SKIP = ("/torch/", "<frozen", "memory_peak.py")


def _where(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py") and ("torchinductor" in name
                                     or not any(s in name for s in _SKIP)):
            text = linecache.getline(name, f.get("line", 0)).strip()
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {text[:110]}"
    return frames[0].get("name", "?") if frames else "?"


@contextlib.contextmanager
def live_at_peak(top: int = 12) -> Iterator[dict[str, Any]]:
    """Record the allocator's history in the block; on exit, fill the dict it yields.

    Everything allocated in the block counts (a model built in it, a compile, CUDA-graph
    captures into private pools); what was allocated before it does not. Recording costs
    time per allocation: do not time steps inside it.

    Args:
        top: how many allocation sites to list.

    Yields:
        A dict, filled on exit: ``{"peak_gb", "sites": [{"gb", "n", "where"}, ...]}``, the
        most the block's own allocations reached and the largest sites live at that moment.
    """
    out: dict[str, Any] = {}
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        yield out
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out.update(peak_of([e for t in snap["device_traces"] for e in t], top))


def peak_of(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """Replay allocator events; the peak of the bytes they allocated and what was live then.

    Args:
        events: the caching allocator's trace (``action``, ``addr``, ``size``, ``frames``);
            frees of blocks allocated before the trace began are ignored.
        top: how many allocation sites to list.

    Returns:
        ``{"peak_gb", "events", "sites": [{"gb", "n", "where"}, ...]}``, sites largest first.
    """
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    at_peak: list[dict[str, Any]] = []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, list(live.values())
        elif e["action"] in ("free_requested", "free") and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in at_peak:
        g = groups[_where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    sites = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_gb": peak / 1e9, "events": len(events),
            "sites": [{"gb": s / 1e9, "n": n, "where": w} for w, (s, n) in sites]}
