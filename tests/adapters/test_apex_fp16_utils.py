"""``adapters.apex.fp16_utils`` against Apex's documented behaviour.

``FP16_Optimizer``: float32 masters of float16 params; ``backward(loss)`` scales, copies
``grad / scale`` into the masters and, with a dynamic scale, skips the step on an inf/NaN
and halves the scale, doubling it after ``scale_window`` clean steps (Apex's amp rule);
``state_dict`` resumes it exactly. The network and master-param helpers as Apex's.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, blobs

from adapters.apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)

INJECT = (1, 4)
STEPS = 7


class Net(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 2)
        self.factor = torch.ones(())

    def forward(self, x):
        h = ScaleGrad.apply(torch.relu(self.fc1(x)), self.factor)
        return self.fc2(h)


def _setup(seed=0, scale_window=2, momentum=0.9):
    model = Net(seed).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False,
                         dynamic_loss_args={"init_scale": 2.0**8, "scale_window": scale_window})
    return model, opt


def _step(model, opt, i, inject=INJECT):
    x, y = blobs(32, seed=i)
    model.factor = torch.tensor(float("inf") if i in inject else 1.0)
    opt.zero_grad()
    loss = F.cross_entropy(model(x.half()).float(), y)
    opt.backward(loss)
    opt.step()
    return loss.item()


def _snapshot(model, opt):
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    moms = [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups
            for p in g["params"] if p in opt.state]
    return [p.detach().clone() for p in model.parameters()], masters, moms


def test_dynamic_scale_skips_halves_and_grows_like_apex():
    model, opt = _setup()
    scales, skipped, snaps = [], [], [_snapshot(model, opt)]
    for i in range(STEPS):
        _step(model, opt, i)
        scales.append(opt.loss_scale)
        skipped.append(opt.overflow)
        snaps.append(_snapshot(model, opt))
    assert skipped == [i in INJECT for i in range(STEPS)]
    # halve on each overflow; double after scale_window=2 clean steps
    assert scales == [256.0, 128.0, 128.0, 256.0, 128.0, 128.0, 256.0]
    for i in range(STEPS):  # a skipped step leaves params, masters and momenta bit-identical
        flat = [[t for part in snaps[j] for t in part] for j in (i, i + 1)]
        same = all(torch.equal(a, b) for a, b in zip(*flat, strict=True))
        assert same == skipped[i], i
    assert model.fc1.weight.dtype == torch.float16
    assert opt.param_groups[0]["params"][0].dtype == torch.float32


def test_a_clean_step_is_sgd_on_the_unscaled_masters():
    model, opt = _setup(momentum=0.0)
    masters_before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    x, y = blobs(32)
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(x.half()).float(), y))
    scale = opt.loss_scale
    grads16 = [p.grad.clone() for p in model.parameters()]
    for m, g in zip(opt.param_groups[0]["params"], grads16, strict=True):
        assert m.grad.dtype == torch.float32
        assert torch.equal(m.grad, g.float() * (1.0 / scale))  # the fp16 grad / scale
    opt.step()
    for m, m0, g, p in zip(opt.param_groups[0]["params"], masters_before, grads16,
                           model.parameters(), strict=True):
        torch.testing.assert_close(m.detach(), m0 - 0.05 * (g.float() * (1.0 / scale)),
                                   rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), m.detach().half())  # copied back to the model


def test_static_scale_is_constant_and_never_skips_as_apex():
    model = Net().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
                         verbose=False)
    _step(model, opt, 0, inject=())
    assert opt.loss_scale == 128.0 and not opt.overflow
    _step(model, opt, 1, inject=(1,))  # Apex's static scaler does not check: the inf goes in
    assert opt.loss_scale == 128.0 and not opt.overflow
    assert not torch.isfinite(model.fc1.weight).all()


def test_state_dict_resumes_bit_exactly():
    model, opt = _setup()
    for i in range(3):
        _step(model, opt, i)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    tail = [(_step(model, opt, i), opt.loss_scale, opt.overflow) for i in range(3, STEPS)]
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain tensors and numbers only
    model2, opt2 = _setup(seed=5)  # other initial weights: everything comes from the file
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    tail2 = [(_step(model2, opt2, i), opt2.loss_scale, opt2.overflow) for i in range(3, STEPS)]
    assert tail == tail2
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_other_params():
    _, opt = _setup()
    sd = opt.state_dict()
    other = FP16_Optimizer(torch.optim.SGD(torch.nn.Linear(3, 3).half().parameters(), lr=0.1),
                           verbose=False)
    with pytest.raises(ValueError, match="do not match this optimizer's params"):
        other.load_state_dict(sd)


def test_clip_master_grads_clips_and_returns_minus_one_after_an_overflow():
    model, opt = _setup()
    x, y = blobs(32)
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(x.half()).float(), y))
    masters = opt.param_groups[0]["params"]
    norm = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters]))
    got = opt.clip_master_grads(norm.item() / 2)
    assert float(got) == pytest.approx(norm.item(), rel=1e-6)
    after = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters]))
    assert after.item() == pytest.approx(norm.item() / 2, rel=1e-4)
    model.factor = torch.tensor(float("inf"))
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(x.half()).float(), y))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None


def test_backward_without_update_accumulates_then_updates_once():
    model, opt = _setup(momentum=0.0)
    x, y = blobs(32)
    opt.zero_grad()
    for xs, ys in zip(x.half().chunk(2), y.chunk(2), strict=True):
        opt.backward(F.cross_entropy(model(xs).float(), ys), update_master_grads=False)
    summed = [p.grad.clone() for p in model.parameters()]
    opt.update_master_grads()
    for m, g in zip(opt.param_groups[0]["params"], summed, strict=True):
        assert torch.equal(m.grad, g.float() * (1.0 / opt.loss_scale))


def test_float32_params_stay_and_their_grads_are_unscaled_in_place():
    model = Net().half()
    model.fc2.float()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=4.0,
                         verbose=False)
    assert opt.param_groups[0]["params"][2] is model.fc2.weight
    x, y = blobs(8)
    h = torch.relu(model.fc1(x.half())).float()
    opt.backward(F.cross_entropy(model.fc2(h), y))
    ref = torch.nn.Linear(16, 2)
    ref.load_state_dict(model.fc2.state_dict())
    F.cross_entropy(ref(h.detach()), y).backward()
    torch.testing.assert_close(model.fc2.weight.grad, ref.weight.grad)


def test_only_float_params_are_accepted():
    lin = torch.nn.Linear(2, 1).double()
    with pytest.raises(TypeError, match=r"got torch\.float64 of shape"):
        FP16_Optimizer(torch.optim.SGD(lin.parameters(), lr=0.1), verbose=False)


def test_existing_momentum_moves_to_the_masters_as_float32():
    model = Net().half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    inner.step()
    opt = FP16_Optimizer(inner, verbose=False)
    for m in opt.param_groups[0]["params"]:
        assert opt.state[m]["momentum_buffer"].dtype == torch.float32


# ---- helpers ----------------------------------------------------------------------------

def test_network_helpers():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    half = network_to_half(net)
    assert isinstance(half[0], tofp16)
    assert half[1][0].weight.dtype == torch.float16
    assert half[1][1].weight.dtype == torch.float32  # affine batch norm kept in float32
    assert half[1][1].running_mean.dtype == torch.float32
    net = convert_network(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                              torch.nn.BatchNorm1d(4, affine=False)),
                          torch.float16)
    assert net[1].running_mean.dtype == torch.float16  # a non-affine batch norm is cast
    bn = BN_convert_float(torch.nn.BatchNorm2d(3).half())
    assert bn.weight.dtype == torch.float32
    m = FP16Model(torch.nn.Linear(4, 2))
    assert m(torch.ones(1, 4)).dtype == torch.float16


@pytest.mark.parametrize("flat", [False, True])
def test_master_param_helpers(flat):
    model = torch.nn.Linear(3, 2).half()
    model_p, master_p = prep_param_lists(model, flat_master=flat)
    assert len(master_p) == (1 if flat else 2)
    assert all(m.dtype == torch.float32 and m.requires_grad for m in master_p)
    for p in model_p:
        p.grad = torch.full_like(p, 0.5)
    model_grads_to_master_grads(model_p, master_p, flat_master=flat)
    assert all(torch.equal(m.grad, torch.full_like(m, 0.5)) for m in master_p)
    with torch.no_grad():
        for m in master_p:
            m.fill_(0.25)
    master_params_to_model_params(model_p, master_p, flat_master=flat)
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model_p)


def test_to_python_float_and_the_standalone_scalers():
    assert to_python_float(torch.tensor([3.0])) == 3.0
    assert to_python_float([4.0]) == 4.0
    s = DynamicLossScaler(init_scale=4.0, scale_window=2)
    w = torch.nn.Parameter(torch.ones(1))
    w.grad = torch.tensor([float("nan")])
    assert s.has_overflow([w])
    s.update_scale(True)
    assert s.loss_scale == 2.0
    s.update_scale(False)
    s.update_scale(False)  # (iter - last_overflow) % window == 0: grow
    assert s.loss_scale == 4.0
    for _ in range(5):
        s.update_scale(True)
    assert s.loss_scale == 1  # never below 1
    assert LossScaler(8.0).loss_scale == 8.0 and not LossScaler().has_overflow([w])
