"""benchmarks/float8.py: the CPU smoke run of every variant, the subprocess runner, the data,
the schedule and the ratios (exact values on synthetic results)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import float8

import fmp

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
HAS_FP8 = hasattr(fmp, "float8")
TINY = ["--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--no-compile"]


def test_tiny_run_in_process_every_variant(tmp_path):
    path = tmp_path / "f8.json"
    out = float8.main([*TINY, "--in-process", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    res = out["results"]
    for v in ("amp_bf16", "fmp_bf16", "fmp_bf16_eagerupd"):
        assert "error" not in res[v], res[v]
        assert res[v]["float8_linears"] == 0 and res[v]["ms"] > 0
    for v in float8.TORCHAO:
        if HAS_TORCHAO:
            assert "error" not in res[v], res[v]
            assert res[v]["float8_linears"] == 8  # 2 blocks x (qkv, proj, fc, out); not head
        else:
            assert res[v] == {"error": "torchao is not installed", "skipped": True}
    for v in ("fmp_fp8_dynamic", "fmp_fp8_delayed", "fmp_fp8_dynamic_eagerupd"):
        if HAS_FP8:
            assert "error" not in res[v], res[v]
            assert res[v]["float8_linears"] == 8
        else:
            assert res[v] == {"error": "this fmp has no fmp.float8", "skipped": True}
    graph = [v for v in res if v.endswith("_graph")]
    assert len(graph) == 1 and res[graph[0]]["skipped"]  # no CUDA here
    # same model, data and seed: three steps end at nearly the same loss everywhere
    losses = [r["loss"] for r in res.values() if "loss" in r]
    assert len(losses) >= 2 and max(losses) - min(losses) < 0.05, losses
    assert abs(res["amp_bf16"]["losses"][0] - math.log(128)) < 0.3  # starts near ln(vocab)
    assert out["config"]["float8_excluded"] == ["head"]
    assert out["ratios"] == float8.ratios(res)


def test_variants_run_in_their_own_process(tmp_path):
    variants = "amp_bf16,fmp_fp8_dynamic" if HAS_FP8 else "amp_bf16"
    out = float8.main([*TINY, "--variants", variants, "--json", str(tmp_path / "f.json")])
    r = out["results"]["amp_bf16"]
    assert "error" not in r, r
    assert r["wall_s"] > 0 and len(r["losses"]) == 2  # steps 1 and 3
    if HAS_FP8:
        assert "error" not in out["results"]["fmp_fp8_dynamic"]
        assert "fmp_fp8_vs_torch_amp_bf16" in out["ratios"]


def test_budget_skips_what_does_not_fit(tmp_path):
    out = float8.main([*TINY, "--in-process", "--variants", "amp_bf16", "--budget-s", "1",
                       "--json", str(tmp_path / "f.json")])
    assert out["results"]["amp_bf16"]["skipped"]
    assert out["results"]["amp_bf16"]["error"].startswith("budget: ")


def test_bad_flags_exit_2(capsys):
    for argv in (["--steps", "1"], ["--warmup", "5", "--steps", "5"], ["--variants", "nope"],
                 ["--in-process"]):
        with pytest.raises(SystemExit) as info:
            float8.main(["--device", "cpu", "--tiny", *argv])
        assert info.value.code == 2, argv
    assert "nope" in capsys.readouterr().err


def test_markov_batches_are_fixed_chains():
    a = float8.markov_batches(50, 16, 3, 2, seed=1, branching=2)
    b = float8.markov_batches(50, 16, 3, 2, seed=1, branching=2)
    assert len(a) == 2 and all(torch.equal(x, y) for p, q in zip(a, b, strict=True)
                               for x, y in zip(p, q, strict=True))
    x, y = a[0]
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    succ: dict[int, set[int]] = {}
    for p, q in a:
        for s, t in zip(p.flatten().tolist(), q.flatten().tolist(), strict=True):
            succ.setdefault(s, set()).add(t)
    assert max(len(s) for s in succ.values()) <= 2
    assert not torch.equal(float8.markov_batches(50, 16, 3, 1, seed=2)[0][0], x)
    with pytest.raises(ValueError, match="got 50, 0"):
        float8.markov_batches(50, 0, 3, 1)


def test_lr_factor_warmup_then_cosine():
    assert float(float8.lr_factor(0, 100)) == pytest.approx(0.1)
    assert float(float8.lr_factor(4, 100)) == pytest.approx(0.5)
    assert float(float8.lr_factor(9, 100)) == pytest.approx(1.0)
    assert float(float8.lr_factor(torch.tensor(54, dtype=torch.int32), 100)) == \
        pytest.approx(0.55)  # half way down the cosine: 0.1 + 0.9 * 0.5
    assert float(float8.lr_factor(99, 100)) == pytest.approx(0.1)


def _r(ms, loss):
    return {"ms": ms, "loss": loss}


def test_ratios_exact():
    res = {"amp_bf16": _r(100.0, 4.0), "torchao_tensorwise": _r(80.0, 4.1),
           "torchao_rowwise": _r(90.0, 4.0), "fmp_fp8_dynamic": _r(70.0, 4.02),
           "fmp_fp8_delayed": _r(75.0, 3.9), "fmp_fp8_dynamic_graph": _r(64.0, 4.04),
           "fmp_bf16": _r(95.0, 4.0)}
    r = float8.ratios(res)
    assert r["fmp_fp8_variant"] == "fmp_fp8_dynamic_graph"
    assert r["torchao_float8_variant"] == "torchao_tensorwise"
    assert r["fmp_fp8_vs_torchao_float8"] == 80.0 / 64.0
    assert r["fmp_fp8_vs_torch_amp_bf16"] == 100.0 / 64.0
    assert r["fmp_fp8_loss_vs_bf16"] == pytest.approx(0.01)
    assert r["torchao_float8_vs_torch_amp_bf16"] == 100.0 / 80.0
    assert r["fmp_bf16_vs_torch_amp_bf16"] == 100.0 / 95.0
    assert r["fmp_bf16_variant"] == "fmp_bf16"
    # the eager-update forms count as fmp's: the faster of each family is the one compared
    res["fmp_bf16_eagerupd"] = _r(90.0, 4.0)
    res["fmp_fp8_delayed_eagerupd_graph"] = _r(60.0, 4.0)
    r = float8.ratios(res)
    assert r["fmp_bf16_vs_torch_amp_bf16"] == 100.0 / 90.0
    assert r["fmp_bf16_variant"] == "fmp_bf16_eagerupd"
    assert r["fmp_fp8_variant"] == "fmp_fp8_delayed_eagerupd_graph"
    assert r["fmp_fp8_vs_torchao_float8"] == 80.0 / 60.0
    del res["fmp_bf16_eagerupd"], res["fmp_fp8_delayed_eagerupd_graph"]
    assert r["loss_vs_bf16"]["fmp_fp8_delayed"] == pytest.approx(0.025)
    # failed or skipped variants take no part; without amp_bf16 no bf16 ratios
    res["fmp_fp8_dynamic_graph"] = {"error": "x"}
    res["torchao_tensorwise"] = {"error": "torchao is not installed", "skipped": True}
    r = float8.ratios(res)
    assert r["fmp_fp8_vs_torchao_float8"] == 90.0 / 70.0
    del res["amp_bf16"]
    r = float8.ratios(res)
    assert "fmp_fp8_vs_torch_amp_bf16" not in r and "fmp_fp8_loss_vs_bf16" not in r
    assert float8.ratios({}) == {}
