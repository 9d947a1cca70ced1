"""Issue 16 item 7: checkpoints of a TrainState, exact, with torch's default loader.

``torch.save(state)`` / ``torch.load(path)`` (weights_only=True, torch's default) and
``state.state_dict()`` / ``TrainState.from_state_dict`` round-trip every record bit for
bit, and training resumed from a checkpoint follows the uninterrupted trajectory exactly.
The DCP / FSDP2 case is in tests/distributed/test_checkpoint_fsdp.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp
from fmp import optim

OPTS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-momentum": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adam-amsgrad": lambda: optim.adam(1e-2, amsgrad=True),
    "adamw": lambda: optim.adamw(1e-2),
    "chain": lambda: optim.chain(optim.trace(0.9), optim.add_decayed_weights(1e-3),
                                 optim.scale_by_learning_rate(lambda c: 0.1 / (1.0 + c))),
}
SCALES = {
    "noop": lambda: fmp.NoOpLossScale(),
    "static": lambda: fmp.StaticLossScale(128.0),
    "dynamic": lambda: fmp.DynamicLossScale.create(initial=2.0**10, period=3, hysteresis=2),
}


def _state(opt, ls, params=None):
    params = params if params is not None else {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    state = fmp.TrainState.create(params, opt, ls, model_state={"bn.running_mean":
                                                                torch.randn(2)})
    # one update, so the moments and counters are not all zero
    grads = {k: torch.randn_like(v) for k, v in params.items()} if isinstance(params, dict) \
        else [torch.randn_like(v) for v in params]
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return state._replace(params=optim.apply_updates(state.params, updates),
                          opt_state=opt_state, step=state.step + 3,
                          loss_scale=state.loss_scale.adjust(torch.tensor(False)))


def _assert_same(a, b):
    assert type(a) is type(b)
    assert type(a.opt_state) is type(b.opt_state)
    assert type(a.loss_scale) is type(b.loss_scale)
    assert a.loss_scale.state_dict() == b.loss_scale.state_dict()
    assert_trees_bit_equal(a._replace(compute_params=None), b._replace(compute_params=None))


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("kind", list(OPTS))
def test_torch_save_then_default_torch_load(tmp_path, kind, scale):
    torch.manual_seed(0)
    state = _state(OPTS[kind](), SCALES[scale]())
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")  # weights_only=True: torch's default
    _assert_same(loaded, state)
    torch.save(state.loss_scale, tmp_path / "ls.pt")  # a record on its own, too
    assert torch.load(tmp_path / "ls.pt").state_dict() == state.loss_scale.state_dict()


def _plain(x, path="sd"):
    """Every node of a state dict is a dict with str keys, a tensor, a number or a str."""
    if isinstance(x, dict):
        assert type(x) is dict, (path, type(x))
        for k, v in x.items():
            assert isinstance(k, str), (path, k)
            _plain(v, f"{path}.{k}")
    else:
        assert isinstance(x, torch.Tensor | int | float | str), (path, type(x))


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("kind", list(OPTS))
def test_state_dict_round_trip_is_exact_and_plain(tmp_path, kind, scale):
    torch.manual_seed(0)
    state = _state(OPTS[kind](), SCALES[scale]())
    sd = state.state_dict()
    _plain(sd)
    assert sd["format"] == "fmp.TrainState/1"
    assert sd["params"]["w"] is state.params["w"]  # the state's own tensors, keyed by name
    _assert_same(fmp.TrainState.from_state_dict(sd), state)
    torch.save(sd, tmp_path / "sd.pt")
    _assert_same(fmp.TrainState.from_state_dict(torch.load(tmp_path / "sd.pt")), state)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def test_other_trees_round_trip_or_are_refused():
    torch.manual_seed(0)
    for params in ([torch.randn(2), torch.randn(3)],
                   OrderedDict([("z", torch.randn(2)), ("a", torch.randn(1))]),
                   {"enc": {"w": torch.randn(2)}, "head": (torch.randn(1), torch.randn(2))}):
        state = fmp.TrainState.create(params, optim.adam())
        back = fmp.TrainState.from_state_dict(state.state_dict())
        _assert_same(back, state)
    state = fmp.TrainState.create(Pair(torch.ones(1), torch.ones(1)), optim.sgd(0.1))
    with pytest.raises(TypeError, match="params is a Pair"):
        state.state_dict()
    with pytest.raises(ValueError, match=r"format 'fmp\.TrainState/1'"):
        fmp.TrainState.from_state_dict({"params": {}})


def _train(state, step, batches):
    for b in batches:
        state, _ = step(state, *b)
    return state


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_resumed_training_is_bit_identical(tmp_path, policy, donate):
    model = mlp(seed=0)
    apply_fn, params, _ = fmp.functional(model)
    factor = {"f": torch.tensor(1.0)}

    def loss_fn(p, x, y):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), factor["f"]).float(), y)

    opt = optim.adamw(1e-2, weight_decay=0.1)
    step = fmp.train_step(loss_fn, opt, policy, donate=donate)
    pol = fmp.get_policy(policy)
    x, y = blobs(64)
    batches = [(x[i::6], y[i::6]) for i in range(6)]

    def fresh():
        return fmp.TrainState.create(pol.cast_to_param(clone_tree(params)), opt,
                                     fmp.DynamicLossScale.create(initial=2.0**12, period=2))

    def run(state, bs, bad=()):
        for i, b in bs:
            factor["f"] = torch.tensor(float("inf") if i in bad else 1.0)
            state, _ = step(state, *b)
        return state

    whole = run(fresh(), enumerate(batches), bad=(1,))
    first = run(fresh(), list(enumerate(batches))[:3], bad=(1,))
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    torch.save(first, tmp_path / "state.pt")
    del first
    for loaded in (fmp.TrainState.from_state_dict(torch.load(tmp_path / "ckpt.pt")),
                   torch.load(tmp_path / "state.pt")):
        resumed = run(loaded, list(enumerate(batches))[3:])
        assert int(resumed.skipped_total) == 1
        _assert_same(resumed, whole)
