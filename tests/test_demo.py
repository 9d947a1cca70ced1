"""``python -m fmp.demo``: the data split, the runs, the outputs and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sklearn", reason="the demo needs the 'demo' extra")
pytest.importorskip("matplotlib", reason="the demo needs the 'demo' extra")
pytest.importorskip("tqdm", reason="the demo needs the 'demo' extra")

from fmp.demo import cli, report, run
from fmp.demo.data import batch_indices, load_digits_split
from fmp.demo.model import make_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESULT_FIELDS = {"policy", "engine", "available", "reason", "test_accuracy", "final_loss",
                 "steps_per_s", "skipped_steps", "final_loss_scale", "peak_memory_mb",
                 "wall_s", "losses", "loss_scales"}
APEX_OK = run.apex_available() is None


# ---------------------------------------------------------------------------------------
# data and model
# ---------------------------------------------------------------------------------------


def test_split_is_deterministic_by_seed_and_stratified():
    a, b, c = load_digits_split(0), load_digits_split(0), load_digits_split(1)
    for ta, tb in zip(a, b, strict=True):
        assert torch.equal(ta, tb)
    assert not torch.equal(a.x_test, c.x_test)
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8)
    assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64
    assert float(a.x_train.min()) == 0.0 and float(a.x_train.max()) == 1.0
    counts = torch.bincount(a.y_test, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37  # stratified: ~36 per class


def test_split_rejects_a_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(0, test_fraction=1.0)


def test_batch_indices_are_deterministic_epochs_without_repeats():
    idx = batch_indices(100, 30, 7, seed=3)
    assert idx.shape == (7, 30)
    assert torch.equal(idx, batch_indices(100, 30, 7, seed=3))
    assert not torch.equal(idx, batch_indices(100, 30, 7, seed=4))
    epoch = idx[:3].flatten()  # 3 full batches per epoch of 100
    assert len(set(epoch.tolist())) == 90
    assert batch_indices(10, 4, 0).shape == (0, 4)
    with pytest.raises(ValueError, match="batch_size"):
        batch_indices(10, 11, 1)


def test_model_init_depends_only_on_the_seed():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b, c = make_model(5), make_model(5), make_model(6)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.conv1.weight, c.conv1.weight)
    assert a(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_cosine_schedule_agrees_for_tensors_and_ints():
    s = run.cosine_lr(0.1, 10)
    for n in (0, 3, 10, 12):
        assert float(s(torch.tensor(n, dtype=torch.int32))) == pytest.approx(s(n), rel=1e-6)
    assert s(0) == pytest.approx(0.1) and s(10) == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_digits_split(0)


def _cfg(**kw):
    kw.setdefault("progress", False)
    return run.DemoConfig(**kw)


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_functional_run_records_every_step(digits, policy):
    r = run.run_policy(policy, digits, _cfg(steps=12))
    assert r.available and r.engine == "fmp.train_step"
    assert len(r.losses) == len(r.loss_scales) == 12
    assert r.losses[-1] < r.losses[0]
    assert 0.0 <= r.test_accuracy <= 100.0 and r.skipped_steps == 0
    assert r.final_loss_scale == (65536.0 if policy == "fp16-mixed" else 1.0)
    assert r.steps_per_s > 0 and r.peak_memory_mb is None


def test_compile_flag_compiles_the_whole_step(digits, monkeypatch):
    calls = []
    real = torch.compile

    def fast_compile(fn, **kw):  # inductor's C++ build is slow on a CPU; same graph capture
        calls.append(kw)
        return real(fn, **{**kw, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", fast_compile)
    torch._dynamo.reset()
    eager = run.run_policy("bf16-mixed", digits, _cfg(steps=4))
    compiled = run.run_policy("bf16-mixed", digits, _cfg(steps=4, compile=True))
    assert calls == [{"fullgraph": True}] * 2  # fmp.compile: the loss, then the update
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)


def test_same_seed_same_run(digits):
    a = run.run_policy("fp32", digits, _cfg(steps=5))
    b = run.run_policy("fp32", digits, _cfg(steps=5))
    assert a.losses == b.losses and a.test_accuracy == b.test_accuracy


@pytest.mark.skipif(not APEX_OK, reason=f"adapters.apex not usable: {run.apex_available()}")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_run(digits, level):
    r = run.run_policy(level, digits, _cfg(steps=12))
    assert r.available and r.engine == "adapters.apex"
    assert len(r.losses) == 12 and r.losses[-1] < r.losses[0]
    assert r.final_loss_scale == 65536.0 and r.skipped_steps == 0


def test_unusable_adapter_is_reported_not_raised(digits, monkeypatch):
    monkeypatch.setattr(run, "apex_available", lambda: "adapters.apex has no amp.initialize")
    r = run.run_policy("o2", digits, _cfg(steps=3))
    assert not r.available and "amp.initialize" in r.reason and r.losses == []
    table = report.format_table([r])
    assert "n/a" in table and "O2" not in table.splitlines()[0]
    assert "o2: unavailable: adapters.apex has no amp.initialize" in table


def test_table_shows_the_difference_to_fp32():
    rows = [run.RunResult("fp32", "fmp.train_step", test_accuracy=97.5, final_loss=0.02,
                          steps_per_s=10.0, skipped_steps=0, final_loss_scale=1.0),
            run.RunResult("fp16-mixed", "fmp.train_step", test_accuracy=96.75,
                          final_loss=0.03, steps_per_s=5.0, skipped_steps=2,
                          final_loss_scale=32768.0)]
    lines = report.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["policy", "engine", "test"]
    assert "-0.75" in lines[3] and "32768" in lines[3] and lines[3].split()[-1] == "-"


# ---------------------------------------------------------------------------------------
# main and the command line
# ---------------------------------------------------------------------------------------


def test_main_writes_table_figure_and_json(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["--steps", "20", "--policies", "fp32,bf16-mixed", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "test acc %" in text and "bf16-mixed" in text and "wall time" in text
    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["steps"] == 20 and doc["config"]["policies"] == ["fp32", "bf16-mixed"]
    assert doc["n_train"] == 1437 and doc["n_test"] == 360 and doc["wall_s"] > 0
    assert [r["policy"] for r in doc["results"]] == ["fp32", "bf16-mixed"]
    for r in doc["results"]:
        assert set(r) == RESULT_FIELDS
        assert r["available"] and len(r["losses"]) == 20 and len(r["loss_scales"]) == 20
        assert 0 <= r["test_accuracy"] <= 100 and r["skipped_steps"] == 0
        assert r["final_loss"] > 0 and r["final_loss_scale"] == 1.0 and r["steps_per_s"] > 0


def test_python_dash_m_fmp_demo_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fmp.demo", "--steps", "2", "--policies", "fp32", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "fp32" in proc.stdout and (tmp_path / "results.json").exists()


def test_defaults():
    cfg, out = cli.parse_args([])
    assert cfg.policies == ("fp32", "bf16-mixed", "fp16-mixed", "O1", "O2")
    assert cfg.device == "cpu" and not cfg.compile and str(out) == "out/demo"
    cfg, _ = cli.parse_args(["--device", "auto", "--policies", " fp32 , O1 "])
    assert cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg.policies == ("fp32", "O1")


@pytest.mark.parametrize(("argv", "flag", "words"), [
    (["--steps", "0"], "--steps", "positive integer"),
    (["--steps", "ten"], "--steps", "positive integer"),
    (["--batch-size", "-4"], "--batch-size", "positive integer"),
    (["--batch-size", "5000"], "--batch-size", "at most 1437"),
    (["--policies", "fp32,bf17-mixed"], "--policies", "unknown policy 'bf17-mixed'"),
    (["--policies", "fp32,,O1"], "--policies", "empty"),
    (["--policies", "fp32,FP32"], "--policies", "twice"),
    (["--policies", "p=f32,c=bf16"], "--policies", "key=dtype"),
    (["--seed", "-1"], "--seed", "integer"),
    (["--lr", "nan"], "--lr", "positive"),
    (["--device", "tpu"], "--device", "invalid choice"),
    (["--stpes", "3"], "--stpes", "unrecognized arguments"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err and err.startswith("usage: python -m fmp.demo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--device", "cuda"])
    assert e.value.code == 2 and "--device" in capsys.readouterr().err


def test_missing_extra_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(cli, "missing_extras", lambda: ["scikit-learn"])
    assert cli.main(["--steps", "1"]) == 1
    assert "pip install -e '.[demo]'" in capsys.readouterr().err


def test_python_dash_m_fmp_delegates_to_the_demo(capsys):
    from fmp.__main__ import main as fmp_main

    with pytest.raises(SystemExit) as e:
        fmp_main(["--help"])
    assert e.value.code == 0 and "python -m fmp.demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# the accuracy promise of the default run
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_run_mixed_policies_within_1_5_points_of_fp32(tmp_path):
    policies = ",".join(p for p in cli.DEFAULT_POLICIES
                        if APEX_OK or p.upper() not in run.APEX_LEVELS)
    assert cli.main(["--policies", policies, "--out", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    acc = {r["policy"]: r["test_accuracy"] for r in doc["results"]}
    assert acc["fp32"] >= 96.5, acc
    for a in acc.values():
        assert abs(a - acc["fp32"]) <= 1.5, acc
