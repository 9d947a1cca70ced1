"""TrainState.create(..., donate=True): the step writes into the module's own tensors.

The default copies params and buffers from fmp.functional on the first donated step (the
module keeps its values), which holds the params twice. With donate=True the state takes
them: no copy, the module follows every update as with torch.optim, bit for bit the same
trajectory as the default, and a skipped step still leaves everything as it was.
"""

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import assert_trees_bit_equal, blobs, clone_tree


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _step(apply_fn, opt, policy):
    def loss_fn(p, ms, x, y):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(out.float(), y), new_ms

    return fmp.train_step(loss_fn, opt, policy, donate=True, has_state=True)


def _module(net):
    return {**dict(net.named_parameters()), **dict(net.named_buffers())}


@pytest.mark.parametrize("opt", [fmp.optim.adamw(1e-2), fmp.optim.sgd(0.1, momentum=0.9),
                                 fmp.optim.chain(fmp.optim.scale(-0.1))])
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_donated_params_train_the_module_in_place_as_the_default_does(opt, policy):
    x, y = blobs(32)
    ref_net = _net()
    apply_ref, p_ref, b_ref = fmp.functional(ref_net)
    ref_step = _step(apply_ref, opt, policy)
    ref = fmp.TrainState.create(p_ref, opt, model_state=b_ref)

    net = _net()
    apply_fn, params, buffers = fmp.functional(net)
    step = _step(apply_fn, opt, policy)
    s = fmp.TrainState.create(params, opt, model_state=buffers, donate=True)
    storage = {k: v.data_ptr() for k, v in _module(net).items()}
    for _ in range(3):
        ref, _ = ref_step(ref, x, y)
        s, _ = step(s, x, y)
    assert_trees_bit_equal(s.params, ref.params)
    assert_trees_bit_equal(s.model_state, ref.model_state)
    assert_trees_bit_equal(s.opt_state, ref.opt_state)
    # no copy was made: the state's tensors are the module's, which hold the trained values
    assert s.params["0.weight"] is params["0.weight"]
    assert {k: v.data_ptr() for k, v in _module(net).items()} == storage
    assert_trees_bit_equal(_module(net), {**ref.params, **ref.model_state})
    assert_trees_bit_equal(_module(ref_net), _module(_net()))  # the default: module kept


def test_a_skipped_donated_step_leaves_the_module_as_it_was():
    net = _net()
    apply_fn, params, buffers = fmp.functional(net)
    opt = fmp.optim.adamw(1e-2)
    step = _step(apply_fn, opt, "fp16-mixed")
    s = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(), buffers,
                              donate=True)
    x, y = blobs(32)
    s, m = step(s, x, y)
    assert not bool(m["skipped"])
    before, opt_before = clone_tree(_module(net)), clone_tree(s.opt_state)
    s, m = step(s, x * float("inf"), y)
    assert bool(m["skipped"])
    assert_trees_bit_equal(_module(net), before)
    assert_trees_bit_equal(s.opt_state, opt_before)


def test_donating_a_tree_twice_is_refused_and_claims_nothing():
    net = _net()
    _, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)
    fmp.TrainState.create(params, opt, donate=True)
    with pytest.raises(ValueError, match=r"'params\.0\.weight' is already held"):
        fmp.TrainState.create(params, opt, donate=True)
    # without donate a second state is still fine: its first step copies
    fmp.TrainState.create(params, opt)


def test_a_step_output_cannot_be_donated_again():
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda p, x: (p["w"] * x).sum(), opt, donate=True)
    s, _ = step(fmp.TrainState.create({"w": torch.ones(3)}, opt, donate=True), torch.ones(3))
    with pytest.raises(ValueError, match="already held"):
        fmp.TrainState.create(s.params, opt, donate=True)


def test_leaves_sharing_storage_are_refused_and_nothing_is_claimed():
    w = torch.randn(4, 3)
    opt = fmp.optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"'params\.a' and 'params\.b' share storage"):
        fmp.TrainState.create({"a": w, "b": w[1:]}, opt, donate=True)
    # the refusal claimed nothing: each tensor can still be donated on its own
    fmp.TrainState.create({"a": w}, opt, donate=True)
    v = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"'model_state\.m' and 'params\.p' share"):
        fmp.TrainState.create({"p": v}, opt, model_state={"m": v[0]}, donate=True)
