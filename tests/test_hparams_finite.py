"""Issue 16 item 5: no inf / NaN hyper-parameter ever reaches the params.

Constant hyper-parameters that are not finite (or out of range) are refused when the
optimizer is built, naming the argument, the value and what is accepted. A schedule that
returns inf, NaN or a negative rate makes the train step skip (flagged in the metrics),
with params and optimizer state bit-identical.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp
from fmp import optim

INF, NAN = float("inf"), float("nan")


BAD = [
    ("sgd lr", lambda v: optim.sgd(v), "learning rate lr"),
    ("sgd momentum", lambda v: optim.sgd(0.1, momentum=v), "momentum"),
    ("sgd dampening", lambda v: optim.sgd(0.1, momentum=0.9, dampening=v), "dampening"),
    ("sgd weight_decay", lambda v: optim.sgd(0.1, weight_decay=v), "weight_decay"),
    ("adam lr", lambda v: optim.adam(v), "learning rate lr"),
    ("adam eps", lambda v: optim.adam(eps=v), "epsilon value eps"),
    ("adam weight_decay", lambda v: optim.adam(weight_decay=v), "weight_decay"),
    ("adam beta1", lambda v: optim.adam(betas=(v, 0.999)), "beta parameter at index 0"),
    ("adamw lr", lambda v: optim.adamw(v), "learning rate lr"),
    ("adamw eps", lambda v: optim.adamw(eps=v), "epsilon value eps"),
    ("adamw weight_decay", lambda v: optim.adamw(weight_decay=v), "weight_decay"),
    ("adamw beta2", lambda v: optim.adamw(betas=(0.9, v)), "beta parameter at index 1"),
    ("scale_by_adam eps", lambda v: optim.scale_by_adam(eps=v), "epsilon value eps"),
    ("trace decay", lambda v: optim.trace(v), "momentum"),
    ("add_decayed_weights", lambda v: optim.add_decayed_weights(v), "weight_decay"),
    ("scale_by_learning_rate", lambda v: optim.scale_by_learning_rate(v), "learning rate"),
    ("scale", lambda v: optim.scale(v), "step_size"),
]


@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(("what", "make", "name"), BAD, ids=[b[0] for b in BAD])
def test_non_finite_hyper_parameters_are_refused_at_construction(what, make, name, value):
    with pytest.raises(ValueError) as e:
        make(value)
    msg = str(e.value)
    assert name in msg and repr(value) in msg and "accepted" in msg, msg
    assert "finite" in msg, msg


@pytest.mark.parametrize(("make", "value"), [
    (lambda v: optim.sgd(v), -0.1),
    (lambda v: optim.sgd(0.1, momentum=v), -0.5),
    (lambda v: optim.adamw(weight_decay=v), -1e-2),
    (lambda v: optim.adam(eps=v), -1e-8),
    (lambda v: optim.adam(betas=(v, 0.999)), 1.0),
    (lambda v: optim.adam(betas=(0.9, v)), 1.5),
])
def test_out_of_range_values_are_refused(make, value):
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        make(value)


def test_finite_edge_values_are_still_accepted():
    optim.sgd(0.0, momentum=0.0, dampening=-1.0)  # dampening: any finite float, as torch
    optim.adam(0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    optim.scale(-2.0)


def _setup(opt):
    model = mlp(seed=0)
    apply_fn, params, _ = fmp.functional(model)
    x, y = blobs(32)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x).float(), y)

    state = fmp.TrainState.create(params, opt, fmp.DynamicLossScale.create(initial=2.0**10))
    return loss_fn, state, (x, y)


def bad_at(k, value):
    """A schedule of 0.05 whose rate is ``value`` at update count ``k``."""
    def schedule(count):
        return torch.where(count == k, torch.tensor(value), torch.tensor(0.05))
    return schedule


OPTS = {
    "sgd": lambda lr: optim.sgd(lr, momentum=0.9),
    "adam": lambda lr: optim.adam(lr),
    "adamw": lambda lr: optim.adamw(lr, weight_decay=0.1),
    "chain": lambda lr: optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(1e-2),
                                    optim.scale_by_learning_rate(lr)),
}


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("value", [NAN, INF, -0.1], ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("kind", list(OPTS))
def test_a_schedule_with_a_bad_rate_skips_the_step(kind, value, donate):
    opt = OPTS[kind](bad_at(1, value))
    loss_fn, state, batch = _setup(opt)
    step = fmp.train_step(loss_fn, opt, "fp32", donate=donate)
    state, m = step(state, *batch)  # count 0: rate 0.05, applied
    assert not bool(m["skipped"]) and bool(m["lr_ok"])
    before = clone_tree((state.params, state.opt_state))
    scale_before = float(state.loss_scale.loss_scale)
    state, m = step(state, *batch)  # count 1: the bad rate
    assert bool(m["skipped"]) and bool(m["grads_finite"]) and not bool(m["lr_ok"])
    assert int(m["skipped_total"]) == 1
    assert_trees_bit_equal((state.params, state.opt_state), before)
    # the grads were finite: the scale is not cut (it counts a good step)
    assert float(state.loss_scale.loss_scale) == scale_before
    # the count did not move, so the next step reads the bad rate again: a schedule that is
    # bad at one count stays bad until the user changes it; change it and training resumes
    opt2 = OPTS[kind](lambda count: torch.tensor(0.05))  # a schedule: the same state kind
    state2, m2 = fmp.train_step(loss_fn, opt2, "fp32", donate=donate)(state, *batch)
    assert not bool(m2["skipped"])
    assert all(bool(torch.isfinite(v).all()) for v in state2.params.values())


def test_a_python_float_schedule_with_a_bad_rate_skips_too():
    opt = optim.sgd(lambda count: math.inf)
    loss_fn, state, batch = _setup(opt)
    before = clone_tree(state.params)
    state, m = fmp.train_step(loss_fn, opt)(state, *batch)
    assert bool(m["skipped"]) and not bool(m["lr_ok"])
    assert_trees_bit_equal(state.params, before)


def test_the_optimizer_alone_never_applies_a_bad_rate():
    # used without train_step, a bad scheduled rate is replaced by 0: no NaN in the update
    for opt in (optim.sgd(lambda c: torch.tensor(NAN)), optim.adamw(lambda c: torch.tensor(INF)),
                optim.scale_by_learning_rate(lambda c: torch.tensor(-1.0))):
        p = {"w": torch.ones(3)}
        s = opt.init(p)
        assert not bool(optim.schedule_ok(opt, s))
        u, _ = opt.update({"w": torch.ones(3)}, s, p)
        assert torch.equal(optim.apply_updates(p, u)["w"], p["w"])


def test_schedule_ok_is_none_without_a_schedule_and_metrics_keep_their_keys():
    opt = optim.adamw(1e-3)
    loss_fn, state, batch = _setup(opt)
    assert optim.schedule_ok(opt, state.opt_state) is None
    _, m = fmp.train_step(loss_fn, opt)(state, *batch)
    assert "lr_ok" not in m
