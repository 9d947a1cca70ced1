"""Norm layers under the mixed presets: their params (and buffers) stay in float32 by
default, as with Apex's keep_batchnorm_fp32 and torch.autocast; module_policies overrides."""

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import assert_trees_bit_equal, clone_tree

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _cnn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 16), torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 3))


def _train(policy, param_policies=None, steps=4, donate=False):
    net = _cnn()
    apply_fn, params, buffers = fmp.functional(net)
    seen = {}

    def loss_fn(p, ms, x, y):
        seen.update({k: v.dtype for k, v in p.items()})
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(out.float(), y), new_ms

    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(loss_fn, opt, policy, has_state=True, donate=donate,
                          param_policies=param_policies)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=256.0),
                                  model_state=clone_tree(buffers))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        state, m = step(state, x, y)
        assert not bool(m["skipped"])
    return state, seen, net


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("donate", [False, True])
def test_bn_cnn_trains_with_norms_in_float32_by_default(policy, donate):
    state, seen, net = _train(policy, donate=donate)
    low = fmp.get_policy(policy).compute_dtype
    norms = {"1.weight", "1.bias", "4.weight", "4.bias", "8.weight", "8.bias"}
    assert {k for k, d in seen.items() if d == F32} == norms
    assert {d for k, d in seen.items() if k not in norms} == {low}
    assert all(v.dtype == F32 for v in state.params.values())
    assert state.model_state["1.running_mean"].dtype == F32
    # the same numbers as saying it with module_policies
    explicit = fmp.module_policies(net, policy, {torch.nn.BatchNorm2d: "fp32",
                                                 torch.nn.GroupNorm: "fp32",
                                                 torch.nn.LayerNorm: "fp32"},
                                   keep_norms_fp32=False)
    ref, _, _ = _train(policy, explicit, donate=donate)
    assert_trees_bit_equal(state.params, ref.params)
    assert_trees_bit_equal(state.model_state, ref.model_state)
    assert_trees_bit_equal(state.opt_state, ref.opt_state)


def test_module_policies_keep_norms_and_overrides_win():
    net = _cnn()
    pols = fmp.module_policies(net, "bf16-mixed")
    assert pols["1.weight"].compute_dtype == F32 and pols["8.bias"].compute_dtype == F32
    assert pols["0.weight"].compute_dtype == BF16
    over = fmp.module_policies(net, "bf16-mixed", {torch.nn.LayerNorm: "bf16-mixed"})
    assert over["8.weight"].compute_dtype == BF16 and over["1.weight"].compute_dtype == F32
    off = fmp.module_policies(net, "fp16-mixed", keep_norms_fp32=False)
    assert {p.compute_dtype for p in off.values()} == {F16}
    # not a mixed preset: nothing changes (the user asked for 16-bit params)
    assert {p.compute_dtype for p in fmp.module_policies(net, "bf16-true").values()} == {BF16}
    assert {p.compute_dtype for p in fmp.module_policies(net, "fp32").values()} == {F32}


def test_user_module_policies_override_the_default_in_the_step():
    """Asking for BatchNorm in bf16 is honoured (and the params' dtypes say so)."""
    net = _cnn()
    pols = fmp.module_policies(net, "bf16-mixed", {torch.nn.GroupNorm: "bf16-mixed",
                                                   torch.nn.LayerNorm: "bf16-mixed"})
    _, seen, _ = _train("bf16-mixed", pols, steps=1)
    assert seen["4.weight"] == BF16 and seen["8.weight"] == BF16 and seen["1.weight"] == F32


def test_a_plain_params_dict_is_cast_whole():
    """No module behind the params: the policy casts every param, as before."""
    vg = fmp.value_and_grad(lambda p, x: (p["weight"] * x).sum(), "bf16-mixed")
    seen = []
    vg2 = fmp.value_and_grad(lambda p, x: seen.append(p["weight"].dtype) or (p["weight"] * x)
                             .sum(), "bf16-mixed")
    vg({"weight": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3))
    vg2({"weight": torch.ones(3)}, fmp.NoOpLossScale(), torch.ones(3))
    assert seen == [BF16]
