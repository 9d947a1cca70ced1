"""Issue 16 item 7: a TrainState with FSDP2-sharded params through torch.distributed.checkpoint.

2 CPU ranks with gloo (worker_checkpoint.py, its own launch): ``dcp.save`` of
``state.state_dict()``, ``dcp.load`` in place into a fresh sharded state, then
``TrainState.from_state_dict``: every shard, moment, counter and loss-scale field comes
back bit for bit, and the resumed updates equal the uninterrupted ones.
"""

from __future__ import annotations

import pytest
from dist_launch import run_ranks
from helpers import assert_trees_bit_equal


@pytest.fixture(scope="module")
def ranks():
    out = run_ranks("worker_checkpoint.py", timeout=150)
    res = [r["fsdp_dcp"] for r in out]
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def test_the_sharded_state_loads_bit_for_bit(ranks):
    for r in ranks:
        assert r["fresh_differed"]  # the load had something to overwrite
        assert r["param"] == ("DTensor", "(Shard(dim=0),)", (32, 8), (16, 8))
        assert r["moment"] == "DTensor"
        assert_trees_bit_equal(r["loaded"], r["saved"])
        assert r["loaded_ls"] == r["saved_ls"]  # scale, counters and hyper-parameters
        assert r["saved_ls"]["period"] == 2 and r["saved_ls"]["hysteresis"] == 3
    # each rank holds its own shard
    assert not (ranks[0]["saved"]["params"]["0.weight"] ==
                ranks[1]["saved"]["params"]["0.weight"]).all()


def test_resumed_updates_equal_the_uninterrupted_ones(ranks):
    for r in ranks:
        assert_trees_bit_equal(r["resumed"], r["cont"])
        assert int(r["resumed"]["step"]) == 4
