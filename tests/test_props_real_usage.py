"""Property tests, real usage: random frozen masks, models with buffers, skipped steps, and
donated steps beside other live states. Whatever the mix, frozen params never move and have
no optimizer state, a skipped step leaves every tensor bit-identical, a donated step writes
into nothing another state or the module holds, and donated equals pure."""

import optree
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmp
from tests.helpers import ScaleGrad, assert_trees_bit_equal, clone_tree

NAMES = ["0.weight", "1.weight", "1.bias", "3.weight", "3.bias"]
INF = torch.tensor(float("inf"))
ONE = torch.tensor(1.0)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12, bias=False), torch.nn.BatchNorm1d(12),
                               torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _build(mask, policy, donate, opt_name):
    net = _net()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in mask)
    apply_fn, params, buffers = fmp.functional(net)

    def loss_fn(p, ms, x, y, f):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(ScaleGrad.apply(out, f).float(), y), new_ms

    opt = {"sgd": fmp.optim.sgd(0.1, momentum=0.9), "adamw": fmp.optim.adamw(1e-2)}[opt_name]
    step = fmp.train_step(loss_fn, opt, policy, donate=donate, has_state=True)
    return net, apply_fn, params, buffers, opt, step


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def _snapshot(net):
    return clone_tree({**dict(net.named_parameters()), **dict(net.named_buffers())})


@given(mask=st.sets(st.sampled_from(NAMES), max_size=len(NAMES) - 1),
       skips=st.lists(st.booleans(), min_size=1, max_size=4),
       policy=st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed"]),
       opt_name=st.sampled_from(["sgd", "adamw"]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_frozen_masks_buffers_skips_and_donation_beside_another_state(mask, skips, policy,
                                                                       opt_name):
    net, apply_fn, params, buffers, opt, donated = _build(mask, policy, True, opt_name)
    *_, pure = _build(mask, policy, False, opt_name)
    module_before = _snapshot(net)
    assert set(params) == set(NAMES) - mask and set(apply_fn.frozen) == mask
    make = lambda: fmp.TrainState.create(  # noqa: E731
        params, opt, fmp.DynamicLossScale.create(initial=2.0 ** 8), model_state=buffers)
    a, b, bystander = make(), make(), make()
    bystander_before = clone_tree(bystander)
    for (x, y), skip in zip(_batches(len(skips)), skips, strict=True):
        f = INF if skip else ONE
        before = clone_tree(a)
        a, ma = donated(a, x, y, f)
        b, mb = pure(b, x, y, f)
        assert bool(ma["skipped"]) == bool(mb["skipped"]) == skip
        if skip:
            for field in ("params", "opt_state", "model_state"):
                assert_trees_bit_equal(getattr(a, field), getattr(before, field))
        leaves = optree.tree_leaves((a.opt_state, b.opt_state))
        assert all(torch.isfinite(t).all() for t in leaves if t.is_floating_point())
    # frozen: never in the state, never moved; the module and the bystander untouched
    for s in (a, b):
        assert set(s.params) == set(NAMES) - mask
        for tree in (s.opt_state.mu if opt_name == "adamw" else s.opt_state.momentum,):
            assert set(tree) == set(NAMES) - mask
    assert_trees_bit_equal(_snapshot(net), module_before)
    assert_trees_bit_equal(bystander, bystander_before)
    # donated and pure agree (torch's fused kernels round a little differently)
    torch.testing.assert_close(a.params, b.params, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.model_state, b.model_state, rtol=1e-4, atol=1e-5)
    # the bystander now trains from the very start the others had
    bystander, _ = donated(bystander, *_batches(1)[0], ONE)
    assert_trees_bit_equal(_snapshot(net), module_before)
