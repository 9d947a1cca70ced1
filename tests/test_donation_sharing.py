"""Donation never writes into tensors another live state (or the module) holds."""

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import assert_trees_bit_equal, blobs, clone_tree, mlp


def _bn_mlp(seed=0):
    torch.manual_seed(seed)
    # no bias before the BatchNorm: its grad is rounding noise, which Adam amplifies
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _setup(opt, policy="fp32", donate=True):
    net = _bn_mlp()
    apply_fn, params, buffers = fmp.functional(net)

    def loss_fn(p, ms, x, y):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(out.float(), y), new_ms

    step = fmp.train_step(loss_fn, opt, policy, donate=donate, has_state=True)
    return net, params, buffers, step


@pytest.mark.parametrize("opt", [fmp.optim.adamw(1e-2), fmp.optim.sgd(0.1, momentum=0.9),
                                 fmp.optim.chain(fmp.optim.scale(-0.1))])
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_two_states_from_one_params_tree(opt, policy):
    net, params, buffers, step = _setup(opt, policy)
    module_before = clone_tree({**dict(net.named_parameters()), **dict(net.named_buffers())})
    a = fmp.TrainState.create(params, opt, model_state=buffers)
    b = fmp.TrainState.create(params, opt, model_state=buffers)
    b_before = clone_tree(b)
    x, y = blobs(32)
    for _ in range(3):
        a, _ = step(a, x, y)
    assert_trees_bit_equal(b, b_before)  # the other state: untouched
    # the module does not follow the trained params (a stated choice: fmp.functional)
    assert_trees_bit_equal({**dict(net.named_parameters()), **dict(net.named_buffers())},
                           module_before)
    # b trains exactly as a did: same start, same steps
    for _ in range(3):
        b, _ = step(b, x, y)
    assert_trees_bit_equal(a.params, b.params)
    assert_trees_bit_equal(a.model_state, b.model_state)
    assert_trees_bit_equal(a.opt_state, b.opt_state)
    # ... and as the pure step does (torch's fused kernel rounds a little differently)
    *_, pure = _setup(opt, policy, donate=False)
    c = fmp.TrainState.create(params, opt, model_state=buffers)
    for _ in range(3):
        c, _ = pure(c, x, y)
    torch.testing.assert_close(a.params, c.params, rtol=1e-4, atol=1e-5)
    # trained values go back into the module when asked for
    net.load_state_dict({**a.params, **a.model_state}, strict=False)
    assert torch.equal(net[0].weight, a.params["0.weight"])


def test_donated_steps_write_in_place_after_the_first_copy():
    opt = fmp.optim.adamw(1e-2)
    _, params, buffers, step = _setup(opt)
    s = fmp.TrainState.create(params, opt, model_state=buffers)
    mu = s.opt_state.mu["0.weight"]
    x, y = blobs(32)
    s, _ = step(s, x, y)
    w = s.params["0.weight"]
    assert w is not params["0.weight"]  # copied once, from the module's tensor
    assert s.opt_state.mu["0.weight"] is mu  # fresh optimizer state: fmp's own, not copied
    for _ in range(2):
        s, _ = step(s, x, y)
    assert s.params["0.weight"] is w  # from then on in place


def test_a_state_from_a_pure_step_is_copied_once_then_donated_in_place():
    net = mlp()
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x), y)

    pure = fmp.train_step(loss_fn, opt)
    donated = fmp.train_step(loss_fn, opt, donate=True)
    x, y = blobs(32)
    s, _ = pure(fmp.TrainState.create(params, opt), x, y)
    w = s.params["0.weight"]
    kept = clone_tree(s)
    other = s._replace(params=clone_tree(s.params))  # a real copy: independent
    s2, _ = donated(s, x, y)  # copied once (a pure step keeps no record of its outputs)
    assert_trees_bit_equal(other.params, kept.params)
    assert_trees_bit_equal(s.params, kept.params)
    w = s2.params["0.weight"]
    s3, _ = donated(s2, x, y)
    assert s3.params["0.weight"] is w


@pytest.mark.slow
def test_donated_step_compiled_whole_leaves_the_module_alone():
    net = mlp()
    apply_fn, params, _ = fmp.functional(net)
    before = clone_tree(dict(net.named_parameters()))
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y), opt, donate=True)
    cstep = fmp.compile(step, whole_graph=True, backend="aot_eager")
    s = fmp.TrainState.create(params, opt)
    for _ in range(2):
        s, m = cstep(s, *blobs(32))
    assert not bool(m["skipped"])
    assert not torch.equal(s.params["0.weight"], before["0.weight"])
    assert_trees_bit_equal(dict(net.named_parameters()), before)
