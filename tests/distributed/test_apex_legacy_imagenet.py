"""The ImageNet-style legacy script (tests/adapters/legacy_apex/imagenet_amp.py, written
for Apex, only its imports changed) on 2 CPU ranks under torchrun: apex DDP, sync BN,
amp O2, a checkpoint each epoch; resuming from epoch 1's checkpoint ends bit for bit
where the uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_launch import ROOT, run_torchrun
from helpers import assert_trees_bit_equal

SCRIPT = str(ROOT / "tests" / "adapters" / "legacy_apex" / "imagenet_amp.py")


def _launch(tmp: Path, name: str, *extra: str) -> list[dict]:
    argv = [SCRIPT, "--opt-level", "O2", "--sync_bn", "--out", str(tmp / name),
            "--checkpoint", str(tmp / f"{name}.ckpt"), *extra]
    proc = run_torchrun(argv, nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [torch.load(tmp / f"{name}.rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imagenet")
    full = _launch(tmp, "full", "--epochs", "2")
    first = _launch(tmp, "first", "--epochs", "1")
    resumed = _launch(tmp, "resumed", "--epochs", "2", "--resume", str(tmp / "first.ckpt"))
    return full, first, resumed


def test_the_script_trains_with_apex_ddp_and_sync_bn(runs):
    full, _, _ = runs
    for r in full:
        assert r["world_size"] == 2
        assert r["ddp_type"] == "adapters.apex.parallel.distributed.DistributedDataParallel"
        assert r["bn_types"] == ["SyncBatchNorm"]
        losses = [t["loss"] for t in r["log"]]
        assert len(losses) == 16 and losses[-1] < 0.8 * losses[0]
        assert r["state_dict"]["features.0.weight"].dtype == torch.float32  # O2 state_dict
    assert_trees_bit_equal(full[0]["state_dict"], full[1]["state_dict"])  # the replicas
    assert full[0]["log"] == full[1]["log"]  # reduced losses, skips and scales agree


def test_resume_from_the_checkpoint_is_bit_exact(runs):
    full, first, resumed = runs
    for f, a, b in zip(full, first, resumed, strict=True):
        assert a["log"] + b["log"] == f["log"]
        assert_trees_bit_equal(b["state_dict"], f["state_dict"])
