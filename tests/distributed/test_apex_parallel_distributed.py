"""``adapters.apex.parallel`` on 2 CPU ranks (gloo); the ranks run worker_apex_parallel.py.

- SyncBatchNorm (via ``convert_syncbn_model``) over two half-batches gives the output,
  input grads, summed affine grads and running statistics of one batch norm over the
  whole batch;
- ``DistributedDataParallel`` under amp O1/O2: an inf in one rank's backward makes every
  rank skip, the replicas stay bit-identical, and the run equals torch's DDP bit for bit;
- Apex's DDP arguments do what Apex documented (averaging, predivide, fp32 all-reduce,
  delay, disable/enable), or raise/warn as said.
"""

from __future__ import annotations

import pytest
import torch
from dist_launch import run_ranks
from helpers import assert_trees_bit_equal
from worker_apex_parallel import INJECT, STEPS, syncbn_inputs


@pytest.fixture(scope="module")
def ranks():
    return run_ranks("worker_apex_parallel.py", timeout=180)


@pytest.fixture
def result(ranks):
    def get(name):
        out = [r[name] for r in ranks]
        for rank, o in enumerate(out):
            assert not (isinstance(o, dict) and "error" in o), f"rank {rank}:\n{o['error']}"
        return out
    return get


def test_syncbn_over_two_ranks_equals_one_batchnorm_over_the_whole_batch(result):
    r0, r1 = result("syncbn")
    x, w, bn = syncbn_inputs()
    for k in range(2):
        xk = (x + k).clone().requires_grad_()
        bn.zero_grad()
        y = bn(xk)
        (y * w).sum().backward()
        got = [r["steps"][k] for r in (r0, r1)]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), y.detach(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([g["x_grad"] for g in got]), xk.grad,
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[0]["w_grad"] + got[1]["w_grad"], bn.weight.grad,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[0]["b_grad"] + got[1]["b_grad"], bn.bias.grad,
                                   rtol=1e-5, atol=1e-5)
    for r in (r0, r1):
        assert r["type"] == "SyncBatchNorm" and r["tracked"] == 2
        torch.testing.assert_close(r["running_mean"], bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["running_var"], bn.running_var, rtol=1e-5, atol=1e-6)
    bn.eval()
    torch.testing.assert_close(torch.cat([r0["eval"], r1["eval"]]), bn(x).detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_ddp_under_amp_skips_on_every_rank_and_equals_torch_ddp(result, level):
    r0, r1 = (r[level] for r in result("ddp_amp"))
    want = [i in INJECT for i in range(STEPS)]
    for r in (r0, r1):
        for kind in ("apex", "torch", "fp32"):
            assert [t["skipped"] for t in r[kind]] == want, kind
            assert [t["loss_scale"] for t in r[kind]] == [2.0**16, 2.0**15, 2.0**15,
                                                          2.0**16, 2.0**16], kind
        tr = r["apex"]
        for i in range(1, STEPS):
            same = all(torch.equal(tr[i]["params"][k], tr[i - 1]["params"][k])
                       for k in tr[i]["params"])
            assert same == want[i], i
        for a, b in zip(r["apex"], r["torch"], strict=True):  # Apex's DDP = torch's DDP
            assert_trees_bit_equal(a["params"], b["params"])
    for kind in ("apex", "fp32"):  # the replicas stay bit-identical
        for a, b in zip(r0[kind], r1[kind], strict=True):
            assert_trees_bit_equal(a["params"], b["params"])


def test_apex_ddp_arguments(result):
    r0, r1 = result("ddp_options")
    for r in (r0, r1):
        g = r["grads"]
        assert g["default"] == 1.5  # the mean of 1 and 2
        assert g["no_average"] == 3.0  # the sum
        assert g["predivide"] == 1.5  # (x / 4) summed, times 4 / world
        assert g["predivide_no_average"] == 0.75  # (x / 4) summed
        assert g["delay"] == 1.5 and g["small_buckets"] == 1.5
        assert g["fp16_in_fp32"] == 1.5
        assert g["enabled_again"] == 1.5
        assert g["reducer_broadcast"] == 0.0  # rank 0's params
        assert g["reducer"] == 1.5 and g["reducer_list"] == [1.5] * 3
        assert g["split_factor"] == 4.0
        assert "shared_param is no longer supported" in r["errors"]["shared_param"]
        assert "group_size must divide the world size 2, got 3" in r["errors"]["group_size"]
        assert r["groups"] == {1: 1, 2: 2}
        w = r["warnings"]
        assert any("retain_allreduce_buffers=True has no torch equivalent" in m
                   for m in w["retain_allreduce_buffers"])
        assert any("allreduce_trigger_params" in m and "message_size" in m
                   for m in w["allreduce_trigger_params"])
        assert any("num_allreduce_streams=2" in m for m in w["num_allreduce_streams"])
        assert any("no NVTX" in m for m in w["prof"])
        assert any("used as gradient_predivide_factor" in m for m in w["split"])
    assert (r0["grads"]["disabled"], r1["grads"]["disabled"]) == (1.0, 2.0)  # local grads
