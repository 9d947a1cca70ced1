"""Checkpoints: bit-exact resume at every opt level, loaded before or after initialize."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from adapters.apex.amp import Amp, AmpError

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(n)]


def train(amp, model, opt, data, start):
    inject = (5,) if amp.loss_scalers[0].dynamic else ()
    outs = []
    for i, (x, y) in enumerate(data[start:], start):
        opt.zero_grad()
        with amp.autocast():
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if i in inject:
                next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
        opt.step()
        outs.append(out.detach().clone())
    return outs


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same_state(a[k], b[k])
        elif isinstance(a[k], list):
            assert len(a[k]) == len(b[k])
            for x, y in zip(a[k], b[k], strict=True):
                assert_same_state(x, y) if isinstance(x, dict) else None
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("level", LEVELS)
def test_resume_is_bit_exact(level, when):
    kw = dict(opt_level=level, verbosity=0)
    if level in ("O4", "O5"):
        kw["loss_scale"] = "dynamic"
    data = batches(10)
    amp = Amp(scale_window=3)
    model, opt = make()
    model, opt = amp.initialize(model, opt, **kw)
    train(amp, model, opt, data[:4], 0)
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(),
                      "amp": amp.state_dict()})
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values()
               if v.is_floating_point())
    ref_outs = train(amp, model, opt, data, 4)

    amp2 = Amp(scale_window=3)
    model2, opt2 = make()
    if when == "before":
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        amp2.load_state_dict(ckpt["amp"])
        model2, opt2 = amp2.initialize(model2, opt2, **kw)
    else:
        model2, opt2 = amp2.initialize(model2, opt2, **kw)
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        amp2.load_state_dict(ckpt["amp"])
    assert amp2.state_dict() == ckpt["amp"]
    outs = train(amp2, model2, opt2, data, 4)
    for a, b in zip(ref_outs, outs, strict=True):
        assert torch.equal(a, b)
    for (n, a), (_, b) in zip(model.state_dict(keep_vars=False).items(),
                              model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    for p, q in zip(amp.master_params(opt), amp2.master_params(opt2), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    assert_same_state(opt.state_dict(), opt2.state_dict())
    assert amp.state_dict() == amp2.state_dict()
    assert not any("fmp_master" in s for s in opt2.state.values())
    if level in ("O2", "O5"):
        assert sum("fmp_master" in s for s in opt.state_dict()["state"].values()) == 4


def test_optimizer_state_dict_carries_masters():
    amp = Amp()
    model, opt = make()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sd = opt.state_dict()
    masters = list(amp.master_params(opt))
    # never stepped: the masters equal the model params, nothing extra is saved
    assert sd["state"] == {}
    train(amp, model, opt, batches(2), 0)
    sd = opt.state_dict()
    n_low = sum(1 for p in model.parameters() if p.dtype == torch.float16)
    assert n_low == 4 and sum("fmp_master" in s for s in sd["state"].values()) == n_low
    for j, p in enumerate(masters):
        if p.dtype == torch.float32 and j in sd["state"] and "fmp_master" in sd["state"][j]:
            assert torch.equal(sd["state"][j]["fmp_master"], p)
    assert not any("fmp_master" in s for s in opt.state.values())  # live state untouched
    sd2 = copy.deepcopy(sd)
    with torch.no_grad():
        masters[0].add_(1.0)
    opt.load_state_dict(sd2)
    assert torch.equal(masters[0], sd["state"][0]["fmp_master"])
    assert torch.equal(model[0].weight, masters[0].half())


def test_stateless_sgd_saves_masters_and_resumes_before_initialize():
    data = batches(6)
    amp = Amp()
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    train(amp, model, opt, data[:3], 0)
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert sum("fmp_master" in s for s in ckpt["opt"]["state"].values()) == 4
    train(amp, model, opt, data, 3)
    amp2 = Amp()
    model2, _ = make()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    model2, opt2 = amp2.initialize(model2, opt2, opt_level="O2", verbosity=0)
    assert not opt2.state
    train(amp2, model2, opt2, data, 3)
    for p, q in zip(amp.master_params(opt), amp2.master_params(opt2), strict=True):
        assert torch.equal(p, q)


def test_amp_state_dict_format_and_errors(caplog):
    amp = Amp()
    model, opt = make()
    amp.initialize(model, opt, num_losses=2, verbosity=0)
    sd = amp.state_dict()
    assert type(sd).__name__ == "OrderedDict"
    assert sd == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
                  "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 0}}
    with pytest.raises(AmpError, match=r'Unexpected key.*"scaler"'):
        amp.load_state_dict({"loss_scaler0": sd["loss_scaler0"], "scaler": {}})
    # by index in the key, not by order; missing/extra scalers are logged
    amp.load_state_dict({"loss_scaler1": {"loss_scale": 8.0, "unskipped": 7},
                         "loss_scaler0": {"loss_scale": 2.0, "unskipped": 1},
                         "loss_scaler5": {"loss_scale": 2.0, "unskipped": 1}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 1},
                                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 7}}
    assert "skipping loss_scaler5" in caplog.text
    # Apex checkpoints could hold scales below the floor: clamped, logged
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-20, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
    assert amp.loss_scale(0) == 1.0 and "clamped" in caplog.text
    with pytest.raises(AmpError, match="numeric"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": "x"}})
