"""benchmarks/ddp_train.py under ``torchrun --nproc-per-node 2`` on CPU with gloo."""

from __future__ import annotations

import re

import pytest
from dist_launch import run_torchrun

STEP = re.compile(r"rank (\d) step (\d+) loss (\S+) skipped (True|False)")
DONE = re.compile(r"rank (\d) done: steps (\d+) skips (\d+) params (\w+) identical across "
                  r"ranks (True|False)")


def launch(*args: str) -> tuple[dict, dict]:
    proc = run_torchrun(["benchmarks/ddp_train.py", "--backend", "gloo", *args], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    steps = {(int(r), int(i)): (float(loss), s == "True")
             for r, i, loss, s in STEP.findall(proc.stdout)}
    done = {int(r): (int(n), int(k), d, same == "True")
            for r, n, k, d, same in DONE.findall(proc.stdout)}
    assert set(done) == {0, 1}, out
    return steps, done


def test_mlp_inf_on_rank_1_skips_on_both_and_params_agree():
    steps, done = launch("--steps", "5", "--inject-inf-rank", "1", "--inject-inf-step", "3")
    for rank in (0, 1):
        assert [steps[rank, i][1] for i in range(5)] == [False, False, False, True, False]
        assert done[rank][:2] == (5, 1) and done[rank][3]
    assert done[0][2] == done[1][2]  # the param digests agree bit for bit
    assert steps[0, 0][0] != steps[1, 0][0]  # per-rank losses (each rank's own shard)
    assert steps[0, 4][0] < steps[0, 0][0]


@pytest.mark.slow
def test_gpt_tiny_smoke():
    steps, done = launch("--model", "gpt", "--tiny", "--steps", "3", "--log-every", "1")
    for rank in (0, 1):
        assert done[rank][:2] == (3, 0) and done[rank][3]
        assert all(not steps[rank, i][1] for i in range(3))
