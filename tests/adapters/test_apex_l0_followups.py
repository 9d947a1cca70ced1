"""Fixes found by running Apex's own L0 amp tests on the H200 (2026-12-04)."""

import pytest
import torch

from adapters.apex import amp
from adapters.apex.amp import _amp_state


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_init_patch_type_picks_the_low_dtype(low):
    h = amp.init(enabled=True, patch_type=low)
    try:
        a = torch.ones(4, 4)
        assert (a @ a).dtype == low
        assert torch.nn.functional.softmax(a.to(low), dim=1).dtype == torch.float32
    finally:
        h._deactivate()
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_init_patch_type_refuses_other_dtypes():
    with pytest.raises(ValueError, match=r"patch_type must be torch\.float16 or torch\.bfloat16"):
        amp.init(enabled=True, patch_type=torch.float64)
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.cuda
def test_loss_scale_write_works_with_a_cuda_default_tensor_type():
    # Apex's tests set the default tensor type to CUDA, then write the scaler's _loss_scale
    torch.set_default_device("cuda")
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        _amp_state.loss_scalers[0]._loss_scale = 4.0
        loss = model(torch.ones(2, 4, dtype=torch.float16)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert _amp_state.loss_scalers[0].loss_scale() == 4.0
    finally:
        torch.set_default_device(None)


def test_o1_cast_cache_is_dropped_at_scale_loss_exit():
    # Apex's cache lived for one scale_loss: a weight changed through .data (no new version
    # for torch) between two steps is cast afresh in the next forward
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    a = amp.Amp()
    model, opt = a.initialize(model, opt, opt_level="O1", loss_scale=1.0, verbosity=0)
    x = torch.ones(2, 4)
    try:
        for _ in range(2):
            model.weight.grad = None
            out = model(x)
            assert out.dtype == torch.float16
            with a.scale_loss((out.float() ** 2).sum(), opt) as scaled:
                scaled.backward()
            w = model.weight.detach().clone()
            expected = 2 * (x @ w.t()).t() @ x  # d sum((x w^T)^2) / dw
            torch.testing.assert_close(model.weight.grad.float(), expected.float(),
                                       rtol=1e-2, atol=1e-2)
            model.weight.data -= 1.0
    finally:
        a._deactivate()


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_o1_rnn_modules_take_a_half_input(cls):
    # Apex ran nn.RNN/LSTM/GRU in half for a half or float input; torch's module refuses an
    # input unlike its weights unless autocast is on
    orig = torch.nn.modules.rnn.RNNBase.check_input
    rnn = cls(8, 8, num_layers=2, bidirectional=True)
    h = amp.init(enabled=True)
    try:
        for typ in (torch.float32, torch.float16):
            x = torch.randn(5, 3, 8, dtype=typ).requires_grad_()
            out, _ = rnn(x)
            assert out.dtype == torch.float16
            out[-1].float().sum().backward()
            assert x.grad.dtype == typ
        assert rnn.weight_ih_l0.dtype == torch.float32
    finally:
        h._deactivate()
    assert torch.nn.modules.rnn.RNNBase.check_input is orig
    with pytest.raises(ValueError, match="does not match weight dtype"):
        rnn(torch.randn(5, 3, 8, dtype=torch.float16))
