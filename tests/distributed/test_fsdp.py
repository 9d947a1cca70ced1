"""FSDP2 (``fully_shard``) on 2 CPU processes with gloo: skips agree across shards.

torch 2.13 runs ``fully_shard`` on CPU with gloo (DTensor params and grads, reduce-scatter,
mixed precision), so this runs in the CPU suite (in the shared launch of conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_trees_bit_equal
from worker_fsdp import INJECT, STEPS


@pytest.fixture
def fsdp(result):
    return result("fsdp_skips")


def test_sharded_verdicts_disagree_and_the_reduced_one_agrees(fsdp):
    r0, r1 = fsdp
    # the inf is in rank 1's shard only: rank 0's local check would have applied the step
    assert [t["local_ok"] for t in r0["trace"]] == [True] * STEPS
    assert [t["local_ok"] for t in r1["trace"]] == [i not in INJECT for i in range(STEPS)]
    for r in fsdp:
        assert [t["ok"] for t in r["trace"]] == [i not in INJECT for i in range(STEPS)]
    assert [float(t["loss_scale"]) for t in r0["trace"]] == [256, 128, 128, 64, 64]
    assert [float(t["loss_scale"]) for t in r1["trace"]] == [256, 128, 128, 64, 64]


def test_params_agree_and_skipped_steps_change_nothing(fsdp):
    r0, r1 = fsdp
    for t0, t1 in zip(r0["trace"], r1["trace"], strict=True):
        assert_trees_bit_equal(t0["params"], t1["params"])
    tr = r0["trace"]
    for i in range(1, STEPS):
        same = all(torch.equal(tr[i]["params"][k], tr[i - 1]["params"][k])
                   for k in tr[i]["params"])
        assert same == (i in INJECT), i
    assert tr[-1]["loss"] < 0.5 * tr[0]["loss"]


def test_the_policy_mapping_takes_effect(fsdp):
    for r in fsdp:
        assert r["param"] == ("DTensor", torch.float32, "(Shard(dim=0),)")  # sharded, f32
        assert r["hidden"] == torch.bfloat16  # computed in bf16 (inner: root=False)
        assert r["logits"] == torch.float32  # the root casts the output
        assert r["grad_dtype"] == torch.float32  # reduced in f32 into f32 grads
