"""Cast behaviour: autocast at O1/O4, the user cast decorators, register_*, disable_casts."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from adapters.apex.amp import Amp, AmpError

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("level,low", [("O1", F16), ("O4", BF16)])
def test_autocast_lists(level, low):
    amp = Amp()
    amp.initialize(torch.nn.Linear(2, 2), opt_level=level, verbosity=0)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    img, k = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    with amp.autocast():
        assert F.linear(x, w).dtype == low
        assert torch.mm(x, w).dtype == low and torch.matmul(x, w).dtype == low
        assert F.conv2d(img, k).dtype == low
        y = F.linear(x, w)
        assert F.cross_entropy(y, torch.tensor([0, 1, 2, 3])).dtype == F32
        assert F.mse_loss(y, y.float()).dtype == F32
        assert (y + x).dtype == F32  # promote widens
        assert torch.cat([y, x]).dtype == F32
        with amp.disable_casts():
            assert torch.mm(x, w).dtype == F32
        with amp.autocast(enabled=False):
            assert torch.mm(x, w).dtype == F32


def test_autocast_is_a_no_op_where_the_model_carries_its_dtype():
    for level in ("O0", "O2", "O3", "O5"):
        amp = Amp()
        amp.initialize(torch.nn.Linear(2, 2), opt_level=level, verbosity=0)
        with amp.autocast():
            assert not torch.is_autocast_enabled("cpu")


def test_user_cast_decorators():
    half_mm = Amp.half_function(torch.mm)
    float_mm = Amp.float_function(torch.mm)
    prom = Amp.promote_function(torch.add)
    a16, a32 = torch.ones(2, 2, dtype=F16), torch.ones(2, 2)
    # outside autocast: unchanged
    assert half_mm(a32, a32).dtype == F32 and prom(a16, a16).dtype == F16
    with torch.autocast("cpu", dtype=F16):
        assert half_mm(a32, a32).dtype == F16
        assert float_mm(a16, a16).dtype == F32
        assert prom(a16, a32).dtype == F32 and prom(a16, a16).dtype == F16
        assert half_mm.__wrapped__ is torch.mm
    with torch.autocast("cpu", dtype=BF16):
        assert half_mm(a32, a32).dtype == BF16
        assert prom(a16, torch.ones(2, 2, dtype=BF16)).dtype == F32


def test_in_place_fp32_op_on_half_tensor_errors_under_float_function():
    inplace = Amp.float_function(torch.Tensor.add_)
    t = torch.ones(2, dtype=F16)
    with torch.autocast("cpu", dtype=F16):
        # t is cast to float32 for the call: the in-place result lands in a copy,
        # so the wrapper is not for in-place ops; Apex raised here, torch casts silently
        out = inplace(t, torch.ones(2))
    assert out.dtype == F32 and torch.equal(t, torch.ones(2, dtype=F16))


def test_register_functions_patch_at_initialize_only_for_o1_style():
    ns = types.SimpleNamespace(mm=torch.mm, add=torch.add, cat=torch.cat)
    amp = Amp()
    amp.register_half_function(ns, "mm")
    amp.register_float_function(ns, "add")
    assert ns.mm is torch.mm  # nothing is patched before initialize
    with pytest.raises(AmpError, match="no function named 'nope'"):
        amp.register_half_function(ns, "nope")
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", verbosity=0)
    amp.register_promote_function(ns, "cat")  # after initialize: patched at once
    x = torch.ones(2, 2)
    with amp.autocast():
        assert ns.mm(x, x).dtype == F16
        assert ns.add(x.half(), x.half()).dtype == F32
        assert ns.cat([x.half(), x]).dtype == F32
    ns2 = types.SimpleNamespace(mm=torch.mm)
    amp2 = Amp()
    amp2.register_half_function(ns2, "mm")
    amp2.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)
    assert ns2.mm is torch.mm


def test_cast_cache_train_eval_train():
    amp = Amp()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(3, 4)
    outs = []
    for _ in range(2):
        model.train()
        with amp.autocast():
            loss = model(x).sum()
        with amp.scale_loss(loss * 2.0**-8, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad(), amp.autocast():
            outs.append(model(x))
    # the second eval sees the stepped weights, not a cached fp16 copy of the old ones
    ref = F.linear(x.half(), model.weight.half(), model.bias.half()).float()
    assert torch.equal(outs[1], ref) and not torch.equal(outs[0], outs[1])
