"""The old handle API: amp.init(...), handle.scale_loss, wrap_optimizer / OptimWrapper."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from adapters.apex import amp
from adapters.apex.amp import _handle, _o1_install

F16, F32 = torch.float16, torch.float32


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_init_signature_members_and_casts():
    h = amp.init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False,
                 allow_banned=False)
    assert isinstance(h, _handle.AmpHandle) and h.is_active() and h.has_cache
    assert h.verbose is False and isinstance(h.cache, dict) and h.loss_scale() == 65536.0
    x = torch.ones(2, 2)
    assert torch.mm(x, x).dtype == F16
    with h._disable_casts():
        assert not h.is_active() and torch.mm(x, x).dtype == F32
    with h.disable_casts():
        assert torch.mm(x, x).dtype == F32
    with amp.default_amp().disable_casts():
        assert torch.mm(x, x).dtype == F32
    h._deactivate()
    assert not h.is_active() and torch.mm(x, x).dtype == F32 and _o1_install.current() is None


def test_disabled_init_is_a_no_op():
    h = amp.init(enabled=False)
    assert isinstance(h, _handle.NoOpHandle) and not h.is_active() and not h.has_cache
    x = torch.ones(2, 2)
    assert torch.mm(x, x).dtype == F32
    loss = torch.ones((), requires_grad=True)
    with h.scale_loss(loss, None) as s:
        assert s is loss
    h._deactivate()


def test_handle_loop_trains_and_skips_on_overflow():
    h = amp.init()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    x, y = batch(0)
    for i in range(6):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        with h.scale_loss(loss, opt) as scaled:
            assert scaled.item() == pytest.approx(loss.item() * h.loss_scale(), rel=1e-3)
            scaled.backward()
            if i == 2:
                model[2].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        after = list(model.parameters())
        if i == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            assert h.loss_scale() == 32768.0
            assert "step" not in opt.__dict__  # the one-shot skip is gone again
        else:
            assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == F32 and p.grad.dtype == F32 for p in model.parameters())


def test_unscaled_grads_equal_the_plain_grads():
    h = amp.init(loss_scale=128.0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    with h.scale_loss(F.cross_entropy(model(x), y), opt) as s:
        s.backward()
    got = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    with h._disable_casts():  # the same half casts by hand, no scaling
        w0, b0, w2, b2 = (p.half() for p in model.parameters())
        out = F.linear(F.relu(F.linear(x.half(), w0, b0)), w2, b2)
        (F.cross_entropy(out.float(), y) * 128.0).backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(g, p.grad / 128.0)


def test_wrap_optimizer_two_losses_skip_and_accumulate():
    h = amp.init()
    model = net()
    opt = h.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    with pytest.raises(RuntimeError, match=r"optimizer\.scale_loss"), \
            h.scale_loss(torch.ones(()), opt):
        pass
    x, y = batch(0)
    for it in range(2):
        opt.zero_grad()
        with opt.scale_loss(F.cross_entropy(model(x), y)) as s:
            s.backward()
        g1 = [p.grad.clone() for p in model.parameters()]
        with opt.scale_loss(F.cross_entropy(model(x), y)) as s:
            s.backward()
            if it == 1:
                model[0].bias.grad[0] = float("nan")
        if it == 0:  # the second loss's grads were added to the first one's
            for g, p in zip(g1, model.parameters(), strict=True):
                assert torch.allclose(p.grad, 2 * g)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                             strict=True))
        assert changed == (it == 0)
    with opt.scale_loss(F.cross_entropy(model(x), y)) as s:
        s.backward()
    with opt.scale_loss(F.cross_entropy(model(x), y)) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="num_loss=2"), \
            opt.scale_loss(F.cross_entropy(model(x), y)):
        pass
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(closure=lambda: 0.0)
    assert opt.param_groups is opt._optimizer.param_groups  # attributes forwarded
    assert opt.state_dict() == opt._optimizer.state_dict()


def test_allow_banned_runs_bce_in_float32():
    model = net()
    x, y = torch.randn(2, 4), torch.rand(2, 3)
    h = amp.init()
    with pytest.raises(NotImplementedError):
        F.binary_cross_entropy(torch.sigmoid(model(x)), y)
    h._deactivate()
    amp.init(allow_banned=True)
    assert F.binary_cross_entropy(torch.sigmoid(model(x)), y).dtype == F32


def test_registered_functions_apply_at_init_and_cache_members():
    amp.register_float_function(torch, "sigmoid")
    try:
        h = amp.init()
        model = net()
        assert torch.sigmoid(model(torch.randn(2, 4))).dtype == F32
        assert id(model[0].weight) in h.cache
        h.remove_cache(model[0].weight)
        assert id(model[0].weight) not in h.cache
        h._clear_cache()
        assert h.cache == {}
    finally:
        amp.default_amp()._registry.clear()


def test_docstring_examples():
    result = doctest.testmod(_handle, extraglobs={**vars(_handle), "torch": torch})
    amp.deactivate()
    assert result.failed == 0
