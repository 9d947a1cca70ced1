"""benchmarks/host_time.py runs on a tiny configuration (CPU) and reports every variant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_host_time_run(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_time.py"), "--tiny", "--device", "cpu",
         "--steps", "2", "--warmup", "1", "--gpt-variants", "amp_fp16_eager,fmp_fp16_eager_donate",
         "--resnet-variants", "", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpt = json.loads(out.read_text())["results"]["gpt"]
    assert set(gpt) == {"amp_fp16_eager", "fmp_fp16_eager_donate"}
    for r in gpt.values():
        assert "error" not in r and r["host_ms"] > 0
    assert abs(gpt["amp_fp16_eager"]["loss"] - gpt["fmp_fp16_eager_donate"]["loss"]) < 0.05
