"""Issue 14 item 5 under DDP: O2 masters match the weights DDP broadcast from rank 0."""

from __future__ import annotations

import pytest
from dist_launch import run_ranks


@pytest.fixture(scope="module")
def ranks():
    out = run_ranks("worker_apex_masters.py", timeout=120)
    for rank, r in enumerate(out):
        res = r["masters_follow_broadcast"]
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
    return [r["masters_follow_broadcast"] for r in out]


def test_masters_follow_ddp_broadcast_replicas_stay_identical(ranks):
    for r in ranks:
        # after every step: model params and masters bit-identical across the ranks
        assert r["same"] == [(True, True)] * 3
