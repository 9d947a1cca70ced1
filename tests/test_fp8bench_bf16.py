"""benchmarks/bf16_masterless.py: the CPU smoke run, the state bytes of each variant (exact)
and the ratios on synthetic results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bf16_masterless as bm

TINY = ["--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--no-compile"]


def test_tiny_run_every_variant(tmp_path):
    out = bm.main([*TINY, "--in-process", "--json", str(tmp_path / "b.json")])
    res = out["results"]
    assert list(res) == bm.VARIANTS
    for v, r in res.items():
        assert "error" not in r, (v, r)
        assert r["skipped_steps"] == 0 and list(r["loss_curve"]) == [3]
    # params + moments (+ compensation) + one grad, per param (a few counters on top)
    bytes_ = {v: r["state_bytes_per_param"] for v, r in res.items()}
    assert bytes_["bf16_mixed"] == pytest.approx(16.0, abs=0.01)  # f32 p, m, v, grad
    assert bytes_["bf16_true_kahan"] == pytest.approx(10.0, abs=0.01)  # bf16 p, m, v, c, g
    assert bytes_["bf16_true_stochastic"] == pytest.approx(8.0, abs=0.01)
    assert bytes_["bf16_true_plain"] == pytest.approx(8.0, abs=0.01)
    assert res["bf16_mixed"]["param_dtype"] == "float32"
    assert res["bf16_true_kahan"]["param_dtype"] == "bfloat16"
    # the mixed state also holds the bf16 compute copy: 12 + 2 (less where the norm layers'
    # float32 params are their own compute copy)
    assert 13.5 < res["bf16_mixed"]["train_state_bytes_per_param"] <= 14.0
    assert res["bf16_true_kahan"]["train_state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert out["ratios"]["bf16_kahan_state_bytes_per_param"] == bytes_["bf16_true_kahan"]
    losses = [r["loss"] for r in res.values()]
    assert max(losses) - min(losses) < 0.05


def test_a_variant_in_its_own_process(tmp_path):
    out = bm.main([*TINY, "--variants", "bf16_true_kahan", "--json", str(tmp_path / "b.json")])
    r = out["results"]["bf16_true_kahan"]
    assert "error" not in r, r
    assert r["wall_s"] > 0 and r["state_bytes_per_param"] == pytest.approx(10.0, abs=0.01)


def test_a_compile_past_its_time_is_rerun_eagerly(tmp_path):
    argv = ["--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1"]
    out = bm.main([*argv, "--variants", "bf16_true_plain", "--compile-timeout-s", "2",
                   "--json", str(tmp_path / "b.json")])
    r = out["results"]["bf16_true_plain"]
    assert "error" not in r, r
    assert r["compiled"] is False and r["compile_error"] == "compiled: timeout after 2 s"


def test_ratios_exact():
    res = {"bf16_mixed": {"loss": 2.0, "state_bytes_per_param": 16.0},
           "bf16_true_kahan": {"loss": 2.02, "state_bytes_per_param": 10.0},
           "bf16_true_plain": {"loss": 2.5, "state_bytes_per_param": 8.0},
           "bf16_true_stochastic": {"error": "boom"}}
    r = bm.ratios(res)
    assert r == {"bf16_kahan_state_bytes_per_param": 10.0,
                 "bf16_mixed_state_bytes_per_param": 16.0,
                 "bf16_true_kahan_loss_vs_bf16_mixed": pytest.approx(0.01),
                 "bf16_true_plain_loss_vs_bf16_mixed": pytest.approx(0.25)}
    assert bm.ratios({"bf16_true_kahan": {"error": "x"}}) == {}


def test_unknown_variant_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        bm.main([*TINY, "--variants", "bf16_true_magic"])
    assert info.value.code == 2
    assert "bf16_true_magic" in capsys.readouterr().err
