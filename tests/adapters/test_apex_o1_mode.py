"""O1 as Apex did it: Apex's cast lists on every torch call after initialize (a mode)."""

from __future__ import annotations

import doctest
import importlib
import logging
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from adapters.apex import amp as apex_amp
from adapters.apex.amp import Amp, _o1_install

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def o1(level="O1", **kw):
    amp = Amp()
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0, **kw)
    return amp, m, o


@pytest.mark.parametrize("level,low", [("O1", F16), ("O4", BF16)])
def test_torch_calls_in_the_loop_are_cast(level, low):
    _, m, _ = o1(level)
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    assert torch.mm(x, w).dtype == low and x.mm(w).dtype == low and (x @ w).dtype == low
    assert torch.matmul(x, w).dtype == low and F.linear(x, w).dtype == low
    assert m[0](x).dtype == low  # a submodule called directly
    head = torch.nn.Linear(3, 2)  # never passed to initialize
    assert head(m(x)).dtype == low
    assert m(x).dtype == low  # outputs of half ops stay half


def test_float_list_and_methods_outside_the_lists():
    o1()
    h = torch.randn(2, 3).half()
    assert F.softmax(h, -1).dtype == F32 and F.log_softmax(h, -1).dtype == F32
    assert torch.exp(h).dtype == F32 and h.sum().dtype == F32 and (h ** 2).dtype == F32
    assert F.layer_norm(h, (3,)).dtype == F32
    assert F.cross_entropy(h, torch.tensor([0, 1])).dtype == F32
    assert h.softmax(-1).dtype == F16 and torch.relu(h).dtype == F16  # not on Apex's lists
    # a float64 argument of a float-list function goes to float32, as Apex's maybe_float
    assert torch.exp(torch.ones(2, dtype=F64)).dtype == F32


def test_promote_rules():
    o1()
    h, f = torch.ones(2, 2).half(), torch.ones(2, 2)
    assert (h + f).dtype == F32 and (h * f).dtype == F32 and (f - h).dtype == F32
    # torch alone keeps half for a float32 0-d operand; Apex's promote gives float32
    assert (h * torch.tensor(2.0)).dtype == F32 and (h * 2.0).dtype == F16
    assert torch.cat([h, f]).dtype == F32 and torch.stack([h, f]).dtype == F32
    assert torch.cat([h, h]).dtype == F16
    assert torch.atan2(h, f).dtype == F32 and torch.addcmul(h, h, f).dtype == F32
    assert (h == f).all() and (f.double() + f).dtype == F64  # other mixes: torch's rules


def test_binary_cross_entropy_is_refused_with_a_half_argument():
    _, m, _ = o1()
    x, y = torch.randn(2, 4), torch.rand(2, 3)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(torch.sigmoid(m(x)), y)
    with pytest.raises(NotImplementedError, match="allow_banned=True"):
        torch.nn.BCELoss()(torch.sigmoid(m(x)), y)
    assert F.binary_cross_entropy(torch.sigmoid(m(x).float()), y).dtype == F32
    assert torch.nn.BCEWithLogitsLoss()(m(x), y).dtype == F32


def test_register_float_function_sigmoid_makes_bce_work():
    amp = Amp()
    amp.register_float_function(torch, "sigmoid")  # Apex's advice in the BCE message
    m = amp.initialize(net(), opt_level="O1", verbosity=0)
    loss = F.binary_cross_entropy(torch.sigmoid(m(torch.randn(2, 4))), torch.rand(2, 3))
    assert loss.dtype == F32 and torch.isfinite(loss)


def test_in_place_ops():
    o1()
    h, f = torch.ones(3).half(), torch.ones(3)
    with pytest.raises(NotImplementedError, match="in-place method exp_ on fp16"):
        h.exp_()
    with pytest.raises(NotImplementedError, match="in-place function exp_ with fp16"):
        torch.exp_(h)
    assert torch.zeros(3).exp_().dtype == F32
    before = h
    h += f  # matches self: stays half, in place
    assert h is before and h.dtype == F16 and torch.equal(h, torch.full((3,), 2.0).half())
    assert h.mul_(f).dtype == F16


def test_rnns_and_cells_in_half_and_grads_float32():
    _ = o1()
    lstm, gru = torch.nn.LSTM(4, 3), torch.nn.GRUCell(4, 3)
    x = torch.randn(5, 2, 4)
    out, (hn, cn) = lstm(x)
    assert out.dtype == F16 and hn.dtype == F16 and cn.dtype == F16
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3]))
    pout, _ = lstm(packed)
    assert isinstance(pout, torch.nn.utils.rnn.PackedSequence) and pout.data.dtype == F16
    assert gru(x[0]).dtype == F16 and torch.nn.LSTMCell(4, 3)(x[0])[0].dtype == F16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == F32 for p in lstm.parameters())


def test_cast_model_outputs_is_honoured():
    _, m, _ = o1(cast_model_outputs=torch.float32)
    x = torch.randn(2, 4)
    assert m(x).dtype == F32 and m[2](m[0](x)).dtype == F16


def test_disable_casts_and_autocast_enabled_false():
    amp, _, _ = o1()
    x = torch.randn(2, 2)
    with amp.disable_casts():
        assert torch.mm(x, x).dtype == F32
        with amp.autocast():  # turns them on again inside
            assert torch.mm(x, x).dtype == F16
    with apex_amp.default_amp().disable_casts():  # any instance switches the one mode
        assert torch.mm(x, x).dtype == F32
    with amp.autocast(enabled=False):
        assert torch.mm(x, x).dtype == F32
    assert torch.mm(x, x).dtype == F16


def test_register_on_a_user_namespace_wraps_and_is_undone():
    def f(a, b):
        return a + b

    ns = types.SimpleNamespace(f=f, mm=torch.mm)
    amp = Amp()
    amp.register_half_function(ns, "f")
    amp.register_float_function(ns, "mm")
    amp.initialize(net(), opt_level="O1", verbosity=0)
    x = torch.ones(2, 2)
    assert ns.f(x, x).dtype == F16 and ns.mm(x, x).dtype == F32 and torch.mm(x, x).dtype == F16
    half_f = Amp.half_function(f)
    assert half_f(x, x).dtype == F16
    apex_amp.deactivate()
    assert ns.f is f and ns.mm is torch.mm and half_f(x, x).dtype == F32


def test_optimizer_step_runs_with_the_casts_off():
    seen = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            p = self.param_groups[0]["params"][0]
            seen.append(torch.mm(p, p.t()).dtype)
            return super().step(closure)

    amp = Amp()
    m = net()
    o = Probe(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O1", verbosity=0)
    loss = F.cross_entropy(m(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]))
    with amp.scale_loss(loss, o) as s:
        s.backward()
    o.step()
    assert seen == [F32]
    sched = torch.optim.lr_scheduler.StepLR(o, 1)  # step stays a bound method
    o.step()
    sched.step()


def test_param_cast_cache_reused_and_never_stale():
    _, m, _ = o1()
    mode = _o1_install.current()
    x = torch.randn(3, 4)
    m(x).float().sum().backward()
    first = {k: v[2] for k, v in mode.cache.items()}
    assert id(m[0].weight) in first
    g1 = m[0].weight.grad.clone()
    m(x).float().sum().backward()  # the cached casts are reused: same objects
    assert all(mode.cache[k][2] is v for k, v in first.items())
    assert torch.equal(m[0].weight.grad, 2 * g1)  # grads still accumulate through them
    with torch.no_grad():
        m[0].weight.add_(1.0)  # changed in place: the cache must not serve the old copy
        ref = F.linear(x.half(), m[0].weight.half(), m[0].bias.half())
        assert torch.equal(m[0](x), ref)


def test_o1_loop_matches_apex_casts_written_by_hand():
    """A training loop, step by step, against the same model with Apex's casts by hand."""
    amp, m, o = o1()
    torch.manual_seed(0)
    ref = net()
    with amp.disable_casts():
        ref_o = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        with amp.scale_loss(loss, o) as s:
            s.backward()
        o.step()
        with amp.disable_casts():
            ref_o.zero_grad()
            h = F.relu(F.linear(x.half(), ref[0].weight.half(), ref[0].bias.half()))
            out = F.linear(h, ref[2].weight.half(), ref[2].bias.half())
            (F.cross_entropy(out.float(), y) * 65536.0).backward()
            for p in ref.parameters():
                p.grad.div_(65536.0)
            ref_o.step()
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q)


def test_the_latest_initialize_decides(caplog):
    o1()
    x = torch.ones(2, 2)
    assert torch.mm(x, x).dtype == F16
    with caplog.at_level(logging.WARNING, logger="adapters.apex"):
        Amp().initialize(net(), opt_level="O2", verbosity=0)
    assert "removes the O1 casts" in caplog.text and torch.mm(x, x).dtype == F32


def test_mode_stack_survives_other_modes():
    from torch.overrides import TorchFunctionMode

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, 2)
    with Other():  # entered before initialize, left after
        with torch.device("cpu"):
            o1()
        assert torch.mm(x, x).dtype == F16
    assert torch.mm(x, x).dtype == F16
    with Other():
        assert torch.mm(x, x).dtype == F16
    assert torch.mm(x, x).dtype == F16


def test_hugging_face_gpt2_trains_at_o1():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = Amp()
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    ids = torch.randint(0, 50, (2, 8))
    losses = []
    for _ in range(3):
        out = model(ids, labels=ids)
        assert out.logits.dtype == F16
        with amp.scale_loss(out.loss, opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert all(p.dtype == F32 for p in model.parameters())
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_torch_compile_under_o1():
    _, m, _ = o1()
    x = torch.randn(2, 4)
    eager = F.softmax(m(x), -1)
    compiled = torch.compile(lambda t: F.softmax(m(t), -1))(x)
    assert compiled.dtype == eager.dtype == F32 and torch.allclose(compiled, eager)
    assert torch.compile(lambda t: m(t))(x).dtype == F16


@pytest.mark.cuda
def test_cuda_only_the_amp_device_is_cast():
    amp = Amp()
    m = amp.initialize(net().cuda(), opt_level="O1", verbosity=0)
    xc, x = torch.randn(2, 4, device="cuda"), torch.randn(2, 4)
    assert m(xc).dtype == F16 and torch.mm(x, x.t()).dtype == F32  # CPU tensors untouched
    assert m(xc).cpu().dtype == F32  # Apex: float32 before the transfer to the CPU
    lstm = torch.nn.LSTM(4, 3).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not part of single contiguous chunk" warning
        out, _ = lstm(torch.randn(5, 2, 4, device="cuda"))
    assert out.dtype == F16
    out.float().sum().backward()
    assert all(p.grad.dtype == F32 for p in lstm.parameters())


@pytest.mark.parametrize("name", ["adapters.apex.amp._o1_mode", "adapters.apex.amp._o1_install",
                                  "adapters.apex.amp._o1_lists"])
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, extraglobs={**vars(mod), "torch": torch})
    apex_amp.deactivate()
    assert result.failed == 0


def test_deepcopy_of_an_o1_optimizer_steps_its_own_params():
    import copy

    _, m, o = o1()
    m2, o2 = copy.deepcopy((m, o))
    loss = F.cross_entropy(m2(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    before = [p.detach().clone() for p in m.parameters()]
    o2.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, m2.parameters(), strict=True))
