"""The catalogue of legacy Apex scripts (tests/adapters/legacy_apex/), written for Apex with
only their imports changed, run as scripts (each in its own process, as a user runs them).

The ImageNet-style DDP script runs on 2 ranks in tests/distributed/test_apex_legacy_imagenet.py.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "legacy_apex"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _run(script: str, tmp: Path, *args: str, name: str = "out") -> dict:
    out = tmp / f"{name}.pt"
    # the caller's environment (CUDA, a PYTHONPATH that holds optree), the repo first
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / script), *args, "--out", str(out)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_optimizer_dynamic_scale_skips_and_halves(tmp_path, device):
    r = _run("fp16_optimizer_simple.py", tmp_path, "--dynamic", "--init-scale",
             str(2.0**24), "--device", device)
    log = r["log"]
    over = [t["overflow"] for t in log]
    assert over[0] and not over[-1]  # 2**24 overflows float16 grads at first
    for prev, t in itertools.pairwise(log):
        want = prev["loss_scale"] / 2 if t["overflow"] else prev["loss_scale"]
        assert t["loss_scale"] == want  # halved on each overflow, kept otherwise
    for t, nxt in itertools.pairwise(log):
        if t["overflow"]:  # a skipped step changes nothing: the next loss is the same
            assert nxt["loss"] == t["loss"]
    assert log[0]["loss_scale"] == 2.0**23 and log[-1]["loss"] < 0.1 * log[0]["loss"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [["--dynamic"], ["--static-loss-scale", "128"]])
def test_fp16_optimizer_save_load_resumes_exactly(tmp_path, device, mode):
    full = _run("fp16_optimizer_simple.py", tmp_path, *mode, "--device", device, name="full")
    resumed = _run("fp16_optimizer_simple.py", tmp_path, *mode, "--device", device,
                   "--save-at", "9", name="resumed")
    assert full["log"] == resumed["log"]
    assert torch.equal(full["weight"], resumed["weight"])
    assert torch.equal(full["bias"], resumed["bias"])
    scales = {t["loss_scale"] for t in full["log"]}
    assert scales == ({2.0**16} if "--dynamic" in mode else {128.0})
    assert full["log"][-1]["loss"] < 0.1 * full["log"][0]["loss"]


def test_fp16_optimizer_clip_master_grads(tmp_path):
    r = _run("fp16_optimizer_simple.py", tmp_path, "--clip", "0.5")
    norms = [t["norm"] for t in r["log"]]
    assert norms[0] > 0.5  # the norm before clipping is returned, as torch's clip_grad_norm_
    assert r["log"][-1]["loss"] < 0.1 * r["log"][0]["loss"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("optimizer", "level", "extra"), [
    ("lamb", "O1", ["--steps", "64", "--gradient_accumulation_steps", "1"]),
    ("adam", "O2", []),
])
def test_bert_finetune_with_fused_optimizers(tmp_path, device, optimizer, level, extra):
    r = _run("bert_finetune.py", tmp_path, "--optimizer", optimizer, "--opt-level", level,
             "--device", device, *extra)
    assert r["optimizer"] == {"lamb": "FusedLAMB", "adam": "FusedAdam"}[optimizer]
    log = r["log"]
    # it learns the task (one sample in 768 either way depends on the platform's rounding:
    # 0.9987 with transformers 5.25 on one CPU, 1.0 on others)
    assert r["accuracy"] >= 0.99
    assert sum(t["loss"] for t in log[-4:]) < 0.75 * sum(t["loss"] for t in log[:4])
    for t in log:  # the kernel's overflow flag agrees with amp's verdict
        assert (t["overflow_buf"] == 1) == t["skipped"]
        assert (t["grad_norm"] == t["grad_norm"] and t["grad_norm"] != float("inf")) \
            == (not t["skipped"])


@pytest.mark.parametrize("device", DEVICES)
def test_bert_fused_adam_o2_follows_a_plain_torch_o2_reference(tmp_path, device):
    """Step by step against Apex's O2 written out in torch (legacy_apex/bert_o2_reference.py).

    lr 1e-3 keeps the run far from overflow, so rounding differences stay small: the losses
    agree to 3e-3 relative and every update's skip and scale are the same.
    """
    args = ("--learning_rate", "1e-3", "--steps", "32", "--device", device)
    ours = _run("bert_finetune.py", tmp_path, "--optimizer", "adam", "--opt-level", "O2",
                *args, name="ours")
    ref = _run("bert_o2_reference.py", tmp_path, *args, name="ref")
    assert len(ours["log"]) == len(ref["log"]) == 16
    for a, b in zip(ours["log"], ref["log"], strict=True):
        assert a["skipped"] == b["skipped"] and a["loss_scale"] == b["loss_scale"]
        assert a["loss"] == pytest.approx(b["loss"], rel=3e-3)
