"""Issue 18's benchmark paths on CPU: the graphed torch.amp peer's eager fallback, a variant
in its own process, the loss check that marks a variant invalid, and the new ratios."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step

TINY = ["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1", "--no-unscale"]


def test_peer_falls_back_to_eager_on_cpu_and_matches_the_eager_step(tmp_path):
    out = train_step.main([*TINY,
        "--models", "gpt", "--gpt-variants", "amp_fp16_eager,amp_graph_fp16,amp_graph_bf16",
        "--out", str(tmp_path), "--machine", "t"])
    gpt = out["results"]["gpt"]
    for v in ("amp_graph_fp16", "amp_graph_bf16"):
        assert gpt[v]["graphed"] is False  # CPU: the step body, not compiled, not captured
        # 1 warm-up, 2 steps timed one by one, the same 2 again back to back
        assert gpt[v]["train_steps"] == 5 and gpt[v]["invalid"] is False
        assert gpt[v]["ms_window"] > 0
        assert gpt[v]["loss_ref_variant"] == f"amp_{v[-4:]}_eager"
    # same GradScaler, same optimizer maths: the fp16 peer's loss is the eager step's
    assert gpt["amp_graph_fp16"]["loss"] == pytest.approx(gpt["amp_fp16_eager"]["loss"],
                                                          rel=1e-5)
    assert gpt["amp_graph_fp16"]["loss_scale"] == gpt["amp_fp16_eager"]["loss_scale"]
    refs = out["loss_references"]["gpt"]
    assert sorted(refs) == ["bf16", "fp16"] and len(refs["fp16"]) == 5


def test_isolate_runs_a_compiled_variant_in_its_own_process(tmp_path):
    out = train_step.main([*TINY,
        "--models", "gpt_medium", "--gpt-medium-variants", "amp_bf16_eager,amp_graph_bf16",
        "--isolate", "--out", str(tmp_path), "--machine", "iso"])
    med = out["results"]["gpt_medium"]
    assert med["amp_graph_bf16"]["isolated"] is True
    assert "isolated" not in med["amp_bf16_eager"]  # eager variants stay in this process
    assert med["amp_graph_bf16"]["process_s"] > med["amp_graph_bf16"]["compile_s"] >= 0
    assert med["amp_graph_bf16"]["invalid"] is False
    data = json.loads((tmp_path / f"iso-{out['date']}.json").read_text())
    assert data["results"]["gpt_medium"]["amp_graph_bf16"]["loss"] == med["amp_graph_bf16"]["loss"]


def test_graph_peer_refuses_resnet():
    with pytest.raises(ValueError, match="GPT models"):
        train_step.build("resnet", "amp_graph_fp16", "cpu", True)


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="'gpt_large'"):
        train_step.build("gpt_large", "amp_fp16_eager", "cpu", True)


def _r(ms, peak=None, compile_s=None, mfu=None, **kw):
    return {"ms": ms, "throughput": 1000.0 / ms, "peak_gb": peak, "compile_s": compile_s,
            "mfu": mfu, "syncs_per_step": 0, "loss": 9.0, **kw}


def test_ratios_on_a_synthetic_run():
    res = {
        "gpt": {
            "amp_fp16_eager": _r(50.0), "fmp_fp16_eager_donate": _r(40.0),
            "amp_graph_fp16": _r(36.0, peak=10.0, compile_s=40.0),
            "fmp_fp16_graph": _r(30.0, peak=8.0, compile_s=120.0, mfu=0.6),
            "amp_graph_bf16": _r(35.0, peak=9.0, compile_s=30.0),
            "fmp_bf16_graph": _r(28.0, peak=9.9, compile_s=90.0, mfu=0.64),
        },
        "resnet": {"amp_fp16_eager": _r(44.0, ms_window=43.0),
                   "fmp_fp16_eager": _r(55.0, ms_window=50.0),
                   "fmp_fp16_eager_donate": _r(48.0, ms_window=42.0)},
        "gpt_medium": {"amp_bf16_eager": _r(100.0, peak=30.0),
                       "amp_graph_bf16": _r(80.0, peak=20.0),
                       "fmp_bf16_graph": _r(64.0, peak=16.0)},
    }
    r = train_step.ratios(res, {})
    assert r["fmp_graph_vs_torch_amp_graph_fp16"] == pytest.approx(36.0 / 30.0)
    assert r["fmp_graph_vs_torch_amp_graph_bf16"] == pytest.approx(35.0 / 28.0)
    assert r["fmp_graph_peak_mem_vs_torch_amp_graph"] == pytest.approx(0.8)
    assert r["fmp_graph_peak_mem_vs_torch_amp_graph_bf16"] == pytest.approx(1.1)
    assert r["fmp_eager_vs_torch_amp_eager"] == pytest.approx(50.0 / 40.0)
    assert r["fmp_eager_vs_torch_amp_eager_resnet50"] == pytest.approx(44.0 / 48.0)
    assert r["fmp_eager_variant_resnet50"] == "fmp_fp16_eager_donate"
    # back-to-back windows: the faster fmp window against the peer's
    assert r["fmp_eager_vs_torch_amp_eager_resnet50_window"] == pytest.approx(43.0 / 42.0)
    assert "fmp_eager_vs_torch_amp_eager_window" not in r  # no GPT windows given
    assert r["fmp_best_variant"] == "fmp_bf16_graph"
    assert r["fmp_mfu_vs_measured_matmul_peak"] == 0.64
    # the best fmp graph is bf16, so its compile time is set against the bf16 peer's
    assert r["fmp_compile_time_vs_torch_amp_graph"] == pytest.approx(3.0)
    assert r["fmp_compile_time_variants"] == ["fmp_bf16_graph", "amp_graph_bf16"]
    assert r["fmp_compiled_vs_torch_amp_compiled"] == pytest.approx(36.0 / 30.0)
    assert r["torch_amp_compiled_variant"] == "amp_graph_fp16"
    assert r["gpt_medium_fmp_graph_vs_torch_amp_best_bf16"] == pytest.approx(80.0 / 64.0)
    assert r["gpt_medium_torch_amp_best_bf16_variant"] == "amp_graph_bf16"
    assert r["gpt_medium_fmp_graph_peak_mem_vs_torch_amp_best_bf16"] == pytest.approx(0.8)
    assert "gpt_medium_fmp_graph_vs_torch_amp_best_fp16" not in r
    assert r["fmp_host_syncs_per_step"] == 0


def test_ratios_take_the_faster_fmp_graph_and_its_build_time():
    """The eager-update graph counts where it is the faster fmp step (its build time then
    is the compile-time ratio's); the other's build time is reported beside."""
    res = {"gpt": {
        "amp_graph_fp16": _r(36.0, peak=10.0, compile_s=40.0),
        "fmp_fp16_graph": _r(35.0, peak=9.0, compile_s=120.0),
        "fmp_fp16_graph_eagerupd": _r(34.0, peak=9.5, compile_s=50.0),
        "amp_graph_bf16": _r(35.0, peak=9.0, compile_s=30.0),
        "fmp_bf16_graph": _r(33.0, peak=9.0, compile_s=90.0),
        "fmp_bf16_graph_eagerupd": _r(34.5, peak=9.0, compile_s=45.0),
    }}
    r = train_step.ratios(res, {})
    assert r["fmp_graph_variant_fp16"] == "fmp_fp16_graph_eagerupd"
    assert r["fmp_graph_vs_torch_amp_graph_fp16"] == pytest.approx(36.0 / 34.0)
    assert r["fmp_graph_peak_mem_vs_torch_amp_graph_fp16"] == pytest.approx(0.95)
    assert r["fmp_graph_variant_bf16"] == "fmp_bf16_graph"
    assert r["fmp_graph_vs_torch_amp_graph_bf16"] == pytest.approx(35.0 / 33.0)
    assert r["fmp_eagerupd_compile_time_vs_torch_amp_graph_bf16"] == pytest.approx(1.5)
    assert r["fmp_compile_time_variants"] == ["fmp_bf16_graph", "amp_graph_bf16"]
    assert r["fmp_compile_time_vs_torch_amp_graph"] == pytest.approx(3.0)


def test_time_steps_window_runs_the_steps_again_back_to_back():
    calls = []

    def step():
        calls.append(1)
        return torch.tensor(float(len(calls)))

    window: list[float] = []
    warm: list[float] = []
    ms, loss = train_step.time_steps(step, "cpu", warmup=2, steps=3, window=window,
                                     warm_loss=warm)
    assert len(ms) == 3 and len(window) == 1 and window[0] >= 0
    assert len(calls) == 2 + 3 + 3 and loss == 8.0  # the loss after the last step run
    assert warm == [2.0]  # the loss after the warm-up
    ms, loss = train_step.time_steps(step, "cpu", warmup=0, steps=2)
    assert len(calls) == 10 and loss == 10.0  # no window asked: no extra steps


def test_invalid_variants_are_marked_and_left_out_of_the_ratios():
    res = {"gpt": {
        "amp_graph_fp16": _r(36.0, loss=9.50, train_steps=3),
        "fmp_fp16_graph": _r(30.0, loss=float("nan"), train_steps=3),
        "amp_graph_bf16": _r(35.0, loss=9.70, train_steps=3),   # 2.1% off: out
        "fmp_bf16_graph": _r(28.0, loss=9.69, train_steps=3),   # 1.99% off: in
        "fmp_fp16_eager": _r(40.0, loss=9.5, train_steps=9),    # no reference that long
        "amp_fp16_eager": {"error": "boom"},
    }}
    refs = {"gpt": {"fp16": [10.8, 10.0, 9.51], "bf16": [10.8, 10.0, 9.5]}}
    train_step.check_losses(res, refs, rtol=0.02)
    g = res["gpt"]
    assert g["amp_graph_fp16"]["invalid"] is False
    assert g["amp_graph_fp16"]["loss_rel_err"] == pytest.approx(0.01 / 9.51)
    assert g["fmp_fp16_graph"]["invalid"] is True and g["fmp_fp16_graph"]["loss_rel_err"] is None
    assert g["amp_graph_bf16"]["invalid"] is True
    assert g["fmp_bf16_graph"]["invalid"] is False
    assert g["fmp_fp16_eager"]["loss_check"] == "no reference"
    assert "invalid" not in g["fmp_fp16_eager"]
    assert "invalid" not in g["amp_fp16_eager"]
    r = train_step.ratios(res, {})
    assert "fmp_graph_vs_torch_amp_graph_fp16" not in r  # fmp's fp16 graph is invalid
    assert "fmp_graph_variant_fp16" not in r  # and no variant is named for it
    assert "fmp_graph_vs_torch_amp_graph_bf16" not in r  # the bf16 peer is invalid
    assert r["invalid_variants_left_out"] == ["gpt:amp_graph_bf16", "gpt:fmp_fp16_graph"]
    assert r["fmp_best_variant"] == "fmp_bf16_graph"


def test_the_loss_check_is_sharp_after_the_warm_up_and_coarse_at_the_end():
    refs = {"gpt": {"fp16": [10.9, 10.5, 10.2, 10.0, 9.9, 9.5, 9.3, 9.0]}}
    res = {"gpt": {
        # rounding that grew over a spiky trajectory: 5% off at the end, exact after warm-up
        "fmp_fp16_graph": _r(30.0, loss=9.45, train_steps=8, warm_loss=10.2, warm_steps=3),
        # 1% off after the warm-up: an update that is not the reference's
        "fmp_fp16_graph_eagerupd": _r(30.0, loss=9.0, train_steps=8, warm_loss=10.302,
                                      warm_steps=3),
        # fine after the warm-up, then far off (or NaN) at the end
        "amp_graph_fp16": _r(31.0, loss=10.5, train_steps=8, warm_loss=10.2, warm_steps=3),
        "fmp_fp16_compiled": _r(31.0, loss=float("nan"), train_steps=8, warm_loss=10.2,
                                warm_steps=3),
        # no warm-up loss (an older result): the sharp tolerance at the end
        "fmp_fp16_eager": _r(40.0, loss=9.06, train_steps=8),
    }}
    train_step.check_losses(res, refs, rtol=0.005, final_rtol=0.10)
    g = res["gpt"]
    assert g["fmp_fp16_graph"]["invalid"] is False
    assert g["fmp_fp16_graph"]["warm_loss_rel_err"] == pytest.approx(0.0)
    assert g["fmp_fp16_graph"]["loss_rel_err"] == pytest.approx(0.45 / 9.0)
    assert g["fmp_fp16_graph_eagerupd"]["invalid"] is True
    assert g["fmp_fp16_graph_eagerupd"]["warm_loss_rel_err"] == pytest.approx(0.01)
    assert g["amp_graph_fp16"]["invalid"] is True
    assert g["fmp_fp16_compiled"]["invalid"] is True
    assert g["fmp_fp16_eager"]["invalid"] is True  # 0.67% at the end, no warm-up loss


def test_precision_of_names():
    assert [train_step.precision_of(v) for v in
            ("fp32", "amp_graph_bf16", "fmp_bf16_graph", "apex_o2", "amp_fp16_eager")] == [
        "fp32", "bf16", "bf16", "fp16", "fp16"]
    assert math.isclose(train_step.LOSS_RTOL, 0.005)
    assert math.isclose(train_step.FINAL_RTOL, 0.10)


def test_merge_recomputes_ratios(tmp_path):
    def part(name, res, p):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"date": "2026-12-05", "machine": name, "device": "x",
                                 "torch": "t", "bf16_peak_tflops": None, "results": res,
                                 "unscale": {}, "ratios": {},
                                 "loss_references": {"gpt_medium": {p: [1.0]}}}))
        return str(f)

    a = part("a", {"gpt_medium": {"amp_bf16_eager": _r(100.0, peak=30.0),
                                  "fmp_bf16_graph": _r(50.0, peak=15.0)}}, "bf16")
    b = part("b", {"gpt_medium": {"amp_fp16_eager": _r(90.0, peak=30.0),
                                  "fmp_fp16_graph": _r(60.0, peak=12.0)}}, "fp16")
    out = train_step.main(["--merge", a, b, "--out", str(tmp_path), "--machine", "m"])
    assert out["ratios"]["gpt_medium_fmp_graph_vs_torch_amp_best_bf16"] == pytest.approx(2.0)
    assert out["ratios"]["gpt_medium_fmp_graph_vs_torch_amp_best_fp16"] == pytest.approx(1.5)
    assert sorted(out["loss_references"]["gpt_medium"]) == ["bf16", "fp16"]
    assert (tmp_path / "m-2026-12-05-merged.json").exists()


def test_single_needs_model_and_variant(capsys):
    with pytest.raises(SystemExit) as info:
        train_step.main(["--device", "cpu", "--single", "gpt", "--result-json", "x.json"])
    assert info.value.code == 2 and "MODEL:VARIANT" in capsys.readouterr().err


def test_reference_losses_are_the_eager_steps_trajectory():
    args = SimpleNamespace(device="cpu", tiny=True)
    a = train_step.reference_losses("gpt", "bf16", 3, args)
    b = train_step.reference_losses("gpt", "bf16", 2, args)
    assert len(a) == 3 and a[:2] == b  # same seed, same data: the same numbers
    assert a[2] < a[0]  # it trains


def test_halfnorm_variant_is_reported_beside_the_default_eager_ratio():
    res = {"gpt": {"amp_fp16_eager": _r(50.0), "fmp_fp16_eager_donate": _r(52.0),
                   "fmp_fp16_eager_donate_halfnorm": _r(45.0)}}
    r = train_step.ratios(res, {})
    # the default ratio keeps the float32 norms (torch.autocast's numerics)
    assert r["fmp_eager_vs_torch_amp_eager"] == pytest.approx(50.0 / 52.0)
    assert r["fmp_eager_variant"] == "fmp_fp16_eager_donate"
    assert r["fmp_eager_halfnorm_vs_torch_amp_eager"] == pytest.approx(50.0 / 45.0)


def test_halfnorm_variant_trains_with_16_bit_layernorms(monkeypatch):
    seen = []
    orig = torch.nn.functional.layer_norm

    def spy(x, shape, weight=None, *a, **k):
        seen.append((x.dtype, None if weight is None else weight.dtype))
        return orig(x, shape, weight, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", spy)
    losses, ln_dtypes = {}, {}
    for v in ("fmp_fp16_eager_donate", "fmp_fp16_eager_donate_halfnorm"):
        seen.clear()
        step, _ = train_step.build("gpt", v, "cpu", True)
        losses[v] = float(step())
        ln_dtypes[v] = set(seen)  # (input, weight) dtypes of every layer_norm call
    assert ln_dtypes["fmp_fp16_eager_donate"] == {(torch.float32, torch.float32)}
    assert ln_dtypes["fmp_fp16_eager_donate_halfnorm"] == {(torch.float16, torch.float16)}
    assert losses["fmp_fp16_eager_donate_halfnorm"] == pytest.approx(
        losses["fmp_fp16_eager_donate"], rel=1e-2)
