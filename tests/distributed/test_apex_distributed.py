"""``adapters.apex`` under DDP (O1, O2) and FSDP2 on 2 CPU processes (gloo).

The scenarios run in the shared launch of conftest.py (``worker_apex.py``); the tests
below check their results: a one-rank overflow makes every rank skip, the replicas stay
bit-identical, and a checkpoint saved on rank 0 resumes every rank bit-exactly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_trees_bit_equal
from worker_apex import BACKWARD, FSDP_INJECT, FSDP_STEPS, GRAD, RESUME_AT, STEPS

from adapters.apex.amp import Amp, AmpError

LEVELS = ["O1", "O2"]
SKIPS = [i in BACKWARD or i in GRAD for i in range(STEPS)]


@pytest.fixture(params=LEVELS)
def ddp(request, result):
    return request.param, result(f"apex_ddp_{request.param.lower()}")


def test_inf_on_one_rank_makes_both_ranks_skip(ddp):
    _, (r0, r1) = ddp
    for r in (r0, r1):
        assert [t["skipped"] for t in r["trace"]] == SKIPS
        # scale_window=2: halved on each overflow, doubled after 2 clean steps
        assert [t["loss_scale"] for t in r["trace"]] == [2.0**16, 2.0**15, 2.0**15, 2.0**16,
                                                         2.0**15, 2.0**15]
        tr = r["trace"]
        for i in range(1, STEPS):  # a skipped step leaves the params bit-identical
            same = all(torch.equal(tr[i]["params"][k], tr[i - 1]["params"][k])
                       for k in tr[i]["params"])
            assert same == SKIPS[i], i
        assert tr[-1]["loss"] < 0.5 * tr[0]["loss"]
    assert r0["amp"] == r1["amp"]


def test_params_identical_across_ranks_bit_for_bit(ddp):
    _, (r0, r1) = ddp
    assert r0["same"] and r1["same"]  # all_gather of the params' bits on the ranks
    for t0, t1 in zip(r0["trace"], r1["trace"], strict=True):
        assert_trees_bit_equal(t0["params"], t1["params"])
    assert r0["trace"][0]["loss"] != r1["trace"][0]["loss"]  # each rank its own batch


def test_wrap_after_initialize_keeps_the_opt_level(ddp):
    level, ranks = ddp
    for r in ranks:
        if level == "O2":  # DDP wraps the cast model; the float32 masters in the optimizer
            assert (r["model_dtype"], r["master_dtype"]) == (torch.float16, torch.float32)
        else:
            assert (r["model_dtype"], r["master_dtype"]) == (torch.float32, torch.float32)
        assert r["state_dict_dtype"] == torch.float32


@pytest.mark.parametrize("load", ["before", "after"])
def test_checkpoint_on_rank_0_resumes_every_rank_bit_exactly(ddp, load):
    _, ranks = ddp
    for r in ranks:
        resumed = r[f"resumed_{load}"]
        assert resumed["same"]
        assert resumed["amp"] == r["amp"]
        for t, want in zip(resumed["trace"], r["trace"][RESUME_AT:], strict=True):
            assert (t["skipped"], t["loss_scale"], t["loss"]) == (
                want["skipped"], want["loss_scale"], want["loss"])
            assert_trees_bit_equal(t["params"], want["params"])


def test_without_a_group_an_inf_after_ddp_reduction_splits_the_replicas(ddp):
    # the control for process_group: the inf written on rank 1 after DDP's all-reduce is
    # rank 1's alone, and only the all-reduced verdict keeps the ranks together
    _, (r0, r1) = ddp
    want = [i in BACKWARD for i in range(GRAD[0] + 1)]
    assert r0["no_group"] == want
    assert r1["no_group"] == [*want[:-1], True]
    assert not r0["no_group_same"] and not r1["no_group_same"]


@pytest.fixture
def fsdp(result):
    return result("apex_fsdp")


def test_fsdp_inf_in_one_shard_makes_both_ranks_skip(fsdp):
    r0, r1 = fsdp
    # the inf is in rank 1's shard only: rank 0's own grads were finite every step
    assert [t["local_ok"] for t in r0["trace"]] == [True] * FSDP_STEPS
    assert [t["local_ok"] for t in r1["trace"]] == [i not in FSDP_INJECT
                                                    for i in range(FSDP_STEPS)]
    want = [i in FSDP_INJECT for i in range(FSDP_STEPS)]
    for r in fsdp:
        assert [t["skipped"] for t in r["trace"]] == want
        assert [t["loss_scale"] for t in r["trace"]] == [2.0**16, 2.0**15, 2.0**15,
                                                         2.0**14, 2.0**14]
        assert r["grad"] == ("DTensor", torch.float32)
        tr = r["trace"]
        for i in range(1, FSDP_STEPS):
            same = all(torch.equal(tr[i]["params"][k], tr[i - 1]["params"][k])
                       for k in tr[i]["params"])
            assert same == want[i], i
        assert tr[-1]["loss"] < tr[0]["loss"]
    for t0, t1 in zip(r0["trace"], r1["trace"], strict=True):
        assert_trees_bit_equal(t0["params"], t1["params"])


def test_fsdp_rejects_opt_levels_that_cast_the_model(fsdp):
    for r in fsdp:
        assert "DTensors (FSDP2 fully_shard)" in r["errors"]["O2"]
        assert "use O1 or O4" in r["errors"]["O2"]


# ---- in this (single, uninitialised) process ----------------------------------------

def test_process_group_is_checked():
    with pytest.raises(AmpError, match="process_group must be None, 'default' or a"):
        Amp(process_group="defualt")
    amp = Amp()
    assert amp.process_group is None
    amp.process_group = "default"
    with pytest.raises(AmpError, match="process_group"):
        amp.process_group = 3
    with pytest.raises(AmpError, match="process_group"):
        amp.process_group = torch.ones(2)


def test_a_group_without_init_process_group_is_a_clear_error():
    assert not torch.distributed.is_initialized()
    amp = Amp(process_group="default")
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", verbosity=0)
    loss = net(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match="not initialised"), \
            amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
