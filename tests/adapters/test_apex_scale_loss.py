"""scale_loss: scaling, the dynamic scale trajectory, skipping, accumulation, logging."""

from __future__ import annotations

import logging

import pytest
import torch

from adapters.apex.amp import Amp
from fmp.loss_scale import _inplace as unscale_mod

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def setup(level="O1", opt=torch.optim.SGD, n_opts=1, amp=None, **kw):
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2) for _ in range(n_opts)]
    opts = [opt(m.parameters(), lr=0.1) for m in models]
    amp = amp or Amp()
    kw.setdefault("verbosity", 0)
    models, opts = amp.initialize(models, opts, opt_level=level, **kw)
    return amp, models, opts


def backward(amp, models, opts, inf=False, loss_id=0, **kw):
    x = torch.ones(4, 3)
    loss = sum(m(x).sum() for m in models) * 2.0**-8  # no natural fp16 overflow at 2**16
    with amp.scale_loss(loss, opts, loss_id=loss_id, **kw) as scaled:
        scaled.backward()
        if inf:
            models[0].weight.grad[0, 0] = float("inf")
    return loss


def test_scaled_loss_is_float_times_scale():
    amp, models, opts = setup("O1")
    x = torch.ones(4, 3)
    loss = models[0](x).sum() * 2.0**-8
    with amp.scale_loss(loss, opts[0]) as scaled:
        assert scaled.dtype == F32
        assert scaled.item() == loss.float().item() * 65536.0
        scaled.backward()
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(models[0].state_dict())
    with torch.autocast("cpu", dtype=F16):
        (ref(x).float().sum() * 2.0**-8).backward()
    assert torch.equal(models[0].weight.grad, ref.weight.grad)


def test_o0_and_o3_yield_the_float_loss_untouched():
    for level in ("O0", "O3"):
        amp, models, opts = setup(level)
        loss = models[0](torch.ones(1, 3).to(models[0].weight.dtype)).sum()
        with amp.scale_loss(loss, opts) as scaled:
            assert scaled.dtype == F32 and torch.equal(scaled, loss.float())


@pytest.mark.parametrize("k", [0, 1, 3])
def test_k_forced_overflows_on_scaler_k(k):
    amp, models, opts = setup("O2", num_losses=4)
    for loss_id in range(4):
        for _ in range(loss_id if loss_id == k else 0):
            opts[0].zero_grad()
            backward(amp, models, opts, inf=True, loss_id=loss_id)
            opts[0].step()
            assert amp.last_step_skipped()
    sd = amp.state_dict()
    assert list(sd) == [f"loss_scaler{i}" for i in range(4)]
    for i in range(4):
        exp = 65536.0 / 2**k if i == k else 65536.0
        assert sd[f"loss_scaler{i}"] == {"loss_scale": exp, "unskipped": 0}


def test_growth_after_window_and_cap():
    amp, models, opts = setup("O1", amp=Amp(scale_window=3), max_loss_scale=2.0**17)
    scales = []
    for i in range(8):
        opts[0].zero_grad()
        backward(amp, models, opts, inf=(i == 6))
        opts[0].step()
        scales.append(amp.loss_scale())
    assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**17, 2.0**17, 2.0**17, 2.0**16, 2.0**16]
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


def test_skipped_step_is_bit_identical_with_adam():
    amp, models, opts = setup("O2", opt=torch.optim.Adam)
    for i in range(4):
        opts[0].zero_grad()
        backward(amp, models, opts, inf=(i == 2))
        sd = {k: v.clone() for k, v in models[0].state_dict().items()}
        masters = [p.detach().clone() for p in amp.master_params(opts[0])]
        state = [{k: v.clone() for k, v in opts[0].state[p].items()}
                 for p in amp.master_params(opts[0])]
        opts[0].step()
        if i == 2:
            assert amp.last_step_skipped(opts[0])
            assert all(torch.equal(v, models[0].state_dict()[k]) for k, v in sd.items())
            for p, m, s in zip(amp.master_params(opts[0]), masters, state, strict=True):
                assert torch.equal(p, m) and p.grad is None
                assert all(torch.equal(opts[0].state[p][k], v) for k, v in s.items())
        else:
            assert not amp.last_step_skipped(opts[0])


@pytest.mark.parametrize("opt", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_optimizer_skips_through_found_inf(opt, level, monkeypatch):
    def make(fused):
        return lambda params, lr: opt(params, lr=lr, fused=fused)

    amp, models, opts = setup(level, opt=make(True))
    ramp, rmodels, ropts = setup(level, opt=make(False))
    assert opts[0]._amp_stash.fused and not ropts[0]._amp_stash.fused
    calls = []
    real_step = opts[0]._amp_stash._orig_step

    def spy(*a, **k):
        calls.append(getattr(opts[0], "found_inf", None))
        return real_step(*a, **k)

    opts[0]._amp_stash._orig_step = spy
    for i in range(5):
        for a, ms, os_ in ((amp, models, opts), (ramp, rmodels, ropts)):
            os_[0].zero_grad()
            backward(a, ms, os_, inf=(i in (1, 3)))
            os_[0].step()
        assert amp.last_step_skipped() == ramp.last_step_skipped() == (i in (1, 3))
        for p, r in zip(amp.master_params(opts[0]), ramp.master_params(ropts[0]), strict=True):
            torch.testing.assert_close(p, r)
    # the fused kernel was called on the skipped step too, with found_inf = 1
    assert len(calls) == 5 and calls[1] is not None and calls[1].item() == 1.0
    assert not hasattr(opts[0], "found_inf")
    assert amp.loss_scale() == ramp.loss_scale() == 2.0**14


def test_multiple_optimizers_in_one_loss_all_skip():
    amp, models, opts = setup("O1", n_opts=2)
    before = [m.weight.detach().clone() for m in models]
    backward(amp, models, opts, inf=True)
    for o in opts:
        o.step()
    assert all(amp.last_step_skipped(o) for o in opts)
    assert all(torch.equal(m.weight, b) for m, b in zip(models, before, strict=True))


def test_accumulation_across_iterations_and_losses_matches_plain_torch():
    for level in ("O0", "O1", "O2"):
        amp, models, opts = setup(level, num_losses=2, loss_scale="dynamic")
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0},
                             "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
        ref = torch.nn.Linear(3, 2)
        ref.load_state_dict(models[0].state_dict())
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.linspace(-1, 1, 12).reshape(4, 3)
        for it in range(4):
            for loss_id in (0, 1):
                loss = (models[0](x) * (loss_id + 1)).pow(2).sum()
                with amp.scale_loss(loss, opts, loss_id=loss_id) as scaled:
                    scaled.backward()
                with torch.autocast("cpu", dtype=F16, enabled=level == "O1"):
                    (ref(x) * (loss_id + 1)).pow(2).sum().backward()
            if it % 2 == 1:  # step every second iteration
                grads = [p.grad.clone() for p in amp.master_params(opts[0])]
                for g, r in zip(grads, ref.parameters(), strict=True):
                    torch.testing.assert_close(g, r.grad, rtol=2e-3, atol=2e-3)
                opts[0].step()
                opts[0].zero_grad()
                ropt.step()
                ropt.zero_grad()
        if level != "O2":
            assert all(torch.equal(p, r) for p, r in zip(models[0].parameters(),
                                                         ref.parameters(), strict=True))


def test_delay_unscale_accumulates_scaled_grads():
    amp, models, opts = setup("O1")
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(models[0].state_dict())
    x = torch.ones(4, 3)
    for delay in (True, True, False):
        with amp.scale_loss(models[0](x).sum() * 2.0**-8, opts,
                            delay_unscale=delay) as scaled:
            scaled.backward()
        with torch.autocast("cpu", dtype=F16):
            (ref(x).sum() * 2.0**-8).backward()
        if delay:
            assert torch.equal(models[0].weight.grad / 65536.0, ref.weight.grad)
    assert torch.equal(models[0].weight.grad, ref.weight.grad)


def test_delay_unscale_with_inf_never_skips_until_unscaled():
    amp, models, opts = setup("O1")
    backward(amp, models, opts, inf=True, delay_unscale=True)
    assert amp.loss_scale() == 65536.0
    backward(amp, models, opts)
    opts[0].step()
    assert amp.last_step_skipped() and amp.loss_scale() == 32768.0


def test_delay_overflow_check_never_skips_nor_moves_the_scale():
    amp, models, opts = setup("O1")
    backward(amp, models, opts, inf=True, delay_overflow_check=True)
    opts[0].step()
    assert not amp.last_step_skipped()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert not torch.isfinite(models[0].weight).all()


def test_exception_in_body_restores_stashed_grads():
    amp, models, opts = setup("O1")
    backward(amp, models, opts)
    g = models[0].weight.grad.clone()
    with pytest.raises(KeyError), amp.scale_loss(models[0](torch.ones(1, 3)).sum(), opts):
        raise KeyError("boom")
    assert torch.equal(models[0].weight.grad, g)


def test_static_scale_never_skips_but_logs(caplog):
    amp, models, opts = setup("O1", loss_scale=128.0)
    with caplog.at_level(logging.WARNING, logger="adapters.apex"):
        backward(amp, models, opts, inf=True)
        opts[0].step()
    assert not amp.last_step_skipped()
    assert "NOT skipped" in caplog.text and amp.loss_scale() == 128.0


def test_floor_warning_and_rate_limited_log(caplog):
    amp, models, opts = setup("O1", min_loss_scale=2.0**14, verbosity=1)
    with caplog.at_level(logging.INFO, logger="adapters.apex"):
        for _ in range(9):
            backward(amp, models, opts, inf=True)
            opts[0].step()
    assert amp.loss_scale() == 2.0**14
    overflow = [r for r in caplog.records if "Skipping step" in r.getMessage()]
    floor = [r for r in caplog.records if "at its floor" in r.getMessage()]
    # overflows 1, 2, 4, 8 are logged; the floor was hit from the 3rd overflow on (7 times)
    assert [r.getMessage().rsplit("occurrence ", 1)[1] for r in overflow] == \
        ["1)", "2)", "4)", "8)"]
    assert len(floor) == 3 and all(r.levelno == logging.WARNING for r in floor)
    caplog.clear()
    amp, models, opts = setup("O1", verbosity=0)
    with caplog.at_level(logging.INFO, logger="adapters.apex"):
        backward(amp, models, opts, inf=True)
    assert caplog.text == ""


def test_default_floor_is_one_and_zero_means_none():
    amp, models, opts = setup("O1", max_loss_scale=4.0)
    for _ in range(5):
        backward(amp, models, opts, inf=True)
    assert amp.loss_scale() == 1.0
    amp, models, opts = setup("O1", max_loss_scale=4.0, min_loss_scale=0)
    for _ in range(5):
        backward(amp, models, opts, inf=True)
    assert amp.loss_scale() == 0.125


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_unscale_fallback_equals_fused(dtype, monkeypatch):
    grads = [torch.randn(5).to(dtype) * 1000, torch.randn(3, 2).to(dtype)]
    bad = [g.clone() for g in grads]
    bad[1][0, 1] = float("nan")
    results = []
    for fused in (True, False):
        monkeypatch.setattr(unscale_mod, "fused_ok", lambda d, t, f=fused: f)
        for gs in (grads, bad):
            gs = [g.clone() for g in gs]
            found = torch.zeros(())
            unscale_mod.unscale_and_check_(gs, torch.tensor(1 / 64.0), found)
            results.append((gs, found.item()))
    assert [r[1] for r in results] == [0.0, 1.0, 0.0, 1.0]
    for a, b in zip(results[0][0], results[2][0], strict=True):
        assert torch.equal(a, b)
