"""Buffers on a skipped step: running statistics either travel in the state (has_state=True)
and come back bit-identical, or the step refuses the in-place update it could not undo."""

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import ScaleGrad, assert_trees_bit_equal, clone_tree

INF = torch.tensor(float("inf"))
ONE = torch.tensor(1.0)


def _cnn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2))


def _batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_readme_way_with_batchnorm_is_refused_before_anything_changes():
    net = _cnn()
    apply_fn, params, _ = fmp.functional(net)
    before = clone_tree(dict(net.named_buffers()))

    def loss_fn(p, x, y):  # the module's own buffers, updated in place
        return F.cross_entropy(apply_fn(p, x).float(), y)

    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(loss_fn, opt, "fp16-mixed")
    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create())
    with pytest.raises(ValueError, match=r"updates running statistics in place \(1\."
                                         r"running_mean\).*has_state=True"):
        step(state, *_batch())
    assert_trees_bit_equal(dict(net.named_buffers()), before)
    # buffers passed without return_buffers would be written into: refused too
    step2 = fmp.train_step(lambda p, ms, x, y: (F.cross_entropy(apply_fn(p, x, buffers=ms)
                                                                .float(), y), ms), opt,
                           has_state=True)
    s2 = fmp.TrainState.create(params, opt, model_state=clone_tree(before))
    with pytest.raises(ValueError, match="in the buffers given"):
        step2(s2, *_batch())
    # eval mode updates nothing: allowed
    net.eval()
    state, m = step(state, *_batch())
    assert not bool(m["skipped"])
    assert_trees_bit_equal(dict(net.named_buffers()), before)


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("donate", [False, True])
def test_overflow_step_leaves_running_stats_bit_identical(policy, donate):
    net = _cnn()
    apply_fn, params, buffers = fmp.functional(net)
    module_buffers = clone_tree(buffers)

    def loss_fn(p, ms, x, y, f):
        out, new_ms = apply_fn(p, x, buffers=ms, return_buffers=True)
        return F.cross_entropy(ScaleGrad.apply(out, f).float(), y), new_ms

    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(loss_fn, opt, policy, has_state=True, donate=donate)
    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(),
                                  model_state=buffers)
    x, y = _batch()
    state, m = step(state, x, y, ONE)
    assert not bool(m["skipped"]) and int(state.model_state["1.num_batches_tracked"]) == 1
    before = clone_tree(state)
    # an overflow in the grads, and an overflow in the forward (inf input: NaN statistics)
    for xb, f in ((x, INF), (torch.full_like(x, float("inf")), ONE)):
        state, m = step(state, xb, y, f)
        assert bool(m["skipped"])
        for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert_trees_bit_equal(state.model_state[k], before.model_state[k])
        assert_trees_bit_equal(state.params, before.params)
        assert_trees_bit_equal(state.opt_state, before.opt_state)
    assert_trees_bit_equal(dict(net.named_buffers()), module_buffers)  # module untouched
