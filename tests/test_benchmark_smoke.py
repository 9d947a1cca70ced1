"""The train-step benchmark runs end to end on a tiny configuration (CPU), and its ratios
are computed from the measured variants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step


def test_tiny_run_writes_results(tmp_path):
    out = train_step.main([
        "--device", "cpu", "--tiny", "--models", "gpt", "--steps", "2", "--warmup", "1",
        "--gpt-variants", "amp_fp16_eager,fmp_fp16_eager,fmp_fp16_eager_donate,fmp_bf16_eager",
        "--rounds", "2",
        "--out", str(tmp_path), "--machine", "smoke",
    ])
    data = json.loads(next(tmp_path.glob("smoke-*.json")).read_text())
    gpt = data["results"]["gpt"]
    for v in ("amp_fp16_eager", "fmp_fp16_eager", "fmp_fp16_eager_donate", "fmp_bf16_eager"):
        assert "error" not in gpt[v], gpt[v]
        assert gpt[v]["ms"] > 0 and gpt[v]["loss"] == pytest.approx(gpt[v]["loss"])
    # same model, same data, same seed: every variant's loss after two steps is close
    assert len(gpt["fmp_fp16_eager"]["ms_rounds"]) == 2
    losses = [gpt[v]["loss"] for v in gpt]
    assert max(losses) - min(losses) < 0.05, losses
    r = data["ratios"]
    assert r["fmp_eager_vs_torch_amp_eager"] == pytest.approx(
        gpt[r["fmp_eager_variant"]]["throughput"] / gpt["amp_fp16_eager"]["throughput"])
    assert "unscale_check_vs_copy_bandwidth" in r
    assert out["ratios"] == r


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        train_step.main(["--device", "cpu", "--steps", "0"])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_memory_peak_replays_allocator_events():
    import memory_peak

    def ev(action, addr, size, where="model.py"):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": f"/x/{where}", "line": 1, "name": "f"}]}

    events = [
        ev("free_requested", 99, 10**9),  # allocated before the trace: ignored
        ev("alloc", 1, 2 * 10**9, "a.py"), ev("alloc", 2, 10**9, "b.py"),
        ev("free_requested", 2, 10**9, "b.py"),
        ev("alloc", 3, 5 * 10**8, "b.py"), ev("alloc", 4, 5 * 10**8, "b.py"),
        ev("alloc", 5, 5 * 10**8, "c.py"),  # the peak: 2 + 0.5 + 0.5 + 0.5 GB
        ev("free_requested", 1, 2 * 10**9, "a.py"),
    ]
    out = memory_peak.peak_of(events)
    assert out["peak_gb"] == pytest.approx(3.5)
    assert [(s["gb"], s["n"]) for s in out["sites"]] == [(2.0, 1), (1.0, 2), (0.5, 1)]
    assert out["sites"][0]["where"].startswith("a.py:1")
