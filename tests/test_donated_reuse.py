"""A donated step consumes the state it is given: passing that state again raises.

The donated step writes params and moments into the input's tensors but returns new
counters (step, optimizer count, loss scale), so the old state object is half updated: a
step on it would pair trained moments with a restarted bias correction, silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp


def _make(donate):
    net = mlp(seed=5)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(lambda p, x, y: F.cross_entropy(apply_fn(p, x).float(), y), opt,
                          "fp16-mixed", donate=donate)
    state = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create(),
                                  donate=donate)
    return step, state, *blobs(64)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_consumed_state_passed_again_raises_and_nothing_moves(compiled):
    step, s0, x, y = _make(True)
    if compiled:
        step = fmp.compile(step, backend="aot_eager", update="eager")
    s1, _ = step(s0, x, y)
    s2, _ = step(s1, x, y)
    kept = clone_tree(s2)
    for old, n in ((s0, 0), (s1, 1)):
        with pytest.raises(ValueError, match=rf"this state \(step {n}\) was already consumed "
                                             r"by a donated step .* Pass the state the last "
                                             r"call returned"):
            step(old, x, y)
    assert_trees_bit_equal(s2, kept)  # the refused calls wrote nothing
    s3, _ = step(s2, x, y)            # the latest state goes on
    assert int(s3.step) == 3 and int(s3.opt_state.count) == 3


def test_without_donation_old_states_stay_usable():
    step, s0, x, y = _make(False)
    s1, _ = step(s0, x, y)
    again, _ = step(s0, x, y)
    assert_trees_bit_equal(again.params, s1.params)


def test_the_check_forgets_states_that_are_gone():
    from fmp import _donation

    step, s0, x, y = _make(True)
    s1, _ = step(s0, x, y)
    n = len(_donation._CONSUMED)
    del s0
    import gc

    gc.collect()
    assert len(_donation._CONSUMED) == n - 1
    assert isinstance(s1.step, torch.Tensor)
