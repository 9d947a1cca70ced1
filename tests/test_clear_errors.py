"""Issue 16 item 8: a clear TypeError / ValueError where an internal error came out.

Each test names the user's mistake (an optimizer state from another optimizer, a state
for other shapes, a malformed ``param_policies``, a missing loss scale, mismatched trees in
``select_tree``) and checks the message names what is wrong and what is accepted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import blobs, mlp

import fmp
from fmp import optim


def _model_step(opt, donate=False, **kw):
    model = mlp(seed=0)
    apply_fn, params, _ = fmp.functional(model)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x).float(), y)

    return model, params, fmp.train_step(loss_fn, opt, donate=donate, **kw), blobs(16)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize(("made_by", "stepped_by", "want"), [
    (optim.sgd(0.1), optim.adamw(1e-3), "AdamState"),
    (optim.adam(1e-3), optim.sgd(0.1, momentum=0.9), "SgdState"),
    (optim.sgd(0.1, momentum=0.9), optim.adam(1e-3), "AdamState"),
    (optim.adam(), optim.trace(0.9), "TraceState"),
    (optim.sgd(0.1), optim.scale_by_learning_rate(lambda c: 0.1), "ScaleByScheduleState"),
], ids=["sgd->adamw", "adam->sgd", "sgdm->adam", "adam->trace", "sgd->schedule"])
def test_a_state_from_another_optimizer(made_by, stepped_by, want, donate):
    _, params, step, batch = _model_step(stepped_by, donate)
    state = fmp.TrainState.create(params, made_by)
    with pytest.raises(TypeError, match=f"needs the {want} made by its own init"):
        step(state, *batch)


def test_momentum_state_from_an_sgd_without_momentum():
    p = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match="no momentum buffers"):
        optim.sgd(0.1, momentum=0.9).update(p, optim.sgd(0.1).init(p), p)
    with pytest.raises(TypeError, match="no nu_max"):
        optim.adam(amsgrad=True).update(p, optim.adam().init(p), p)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_params_of_another_shape_than_the_optimizer_state(kind, donate):
    opt = optim.sgd(0.1, momentum=0.9) if kind == "sgd" else optim.adamw(1e-3)
    _, params, step, (x, _) = _model_step(opt, donate)
    state = fmp.TrainState.create(params, opt)
    # the last layer resized to 1 output (a broadcastable shape: torch would not complain)
    grown = dict(params, **{"2.bias": torch.zeros(1), "2.weight": torch.zeros(1, 32)})
    y1 = torch.zeros(16, 1)

    def loss_fn(p, x, y):
        h = F.gelu(F.linear(x, p["0.weight"], p["0.bias"]))
        return F.mse_loss(F.linear(h, p["2.weight"], p["2.bias"]), y)

    step = fmp.train_step(loss_fn, opt, donate=donate)
    with pytest.raises(ValueError, match=r"leaf '2.bias' has shape \(2,\) but its grad "
                                         r"\(and param\) has shape \(1,\)"):
        step(state._replace(params=grown), x, y1)


def test_apply_updates_refuses_a_broadcasting_shape():
    with pytest.raises(ValueError, match=r"updates leaf 'w' has shape \(3,\) but its param"):
        optim.apply_updates({"w": torch.ones(1)}, {"w": torch.ones(3)})


@pytest.mark.parametrize("builder", ["value_and_grad", "train_step"])
@pytest.mark.parametrize(("pp", "match"), [
    (["fp32"], "param_policies must be a dict from parameter name to fmp.Policy.*got a list"),
    ((fmp.get_policy("fp32"),), "got a tuple"),
    ({"0.weight": "bf16-mixed"},
     r"param_policies\['0.weight'\] is a str \('bf16-mixed'\).*fmp.get_policy"),
    ({"0.weight": None}, r"param_policies\['0.weight'\] is a NoneType"),
    ({0: fmp.get_policy("fp32")}, "keys must be parameter names"),
])
def test_malformed_param_policies(builder, pp, match):
    def loss_fn(p, x):
        return (p["0.weight"] * x).sum()

    with pytest.raises(TypeError, match=match):
        if builder == "value_and_grad":
            fmp.value_and_grad(loss_fn, param_policies=pp)
        else:
            fmp.train_step(loss_fn, optim.sgd(0.1), param_policies=pp)


def test_module_policies_are_still_accepted():
    model, params, _, (x, y) = _model_step(optim.sgd(0.1))
    pp = fmp.module_policies(model, "bf16-mixed")
    step = fmp.train_step(lambda p, x, y: F.cross_entropy(
        fmp.functional(model)[0](p, x).float(), y), optim.sgd(0.1), "bf16-mixed",
        param_policies=pp)
    _, m = step(fmp.TrainState.create(params, optim.sgd(0.1)), x, y)
    assert not bool(m["skipped"])


@pytest.mark.parametrize(("ls", "match"), [
    (None, "got NoneType None"),
    (128.0, r"got float 128.0; for a fixed scale pass fmp.StaticLossScale\(128.0\)"),
    (torch.tensor(2.0), "got Tensor"),
])
def test_value_and_grad_needs_a_loss_scale_record(ls, match):
    vg = fmp.value_and_grad(lambda p, x: (p["w"] * x).sum())
    with pytest.raises(TypeError, match="loss_scale must be an fmp loss-scale record"):
        vg({"w": torch.ones(2)}, ls, torch.ones(2))
    with pytest.raises(TypeError, match=match):
        vg({"w": torch.ones(2)}, ls, torch.ones(2))


def test_select_tree_names_the_leaf_of_mismatched_shapes():
    t = torch.tensor(True)
    with pytest.raises(ValueError, match=r"leaf 'enc.w' has shape \(3,\) in on_true and "
                                         r"\(1,\) in on_false"):
        fmp.select_tree(t, {"enc": {"w": torch.ones(3)}}, {"enc": {"w": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"leaf '1' has shape \(2, 2\) in on_true and \(\)"):
        fmp.select_tree(t, [torch.ones(1), torch.ones(2, 2)], [torch.ones(1), torch.ones(())])
    # same shapes, other dtypes: still fine (the on_true dtype is kept)
    out = fmp.select_tree(torch.tensor(False), {"w": torch.ones(2)},
                          {"w": torch.zeros(2, dtype=torch.bfloat16)})
    assert out["w"].dtype == torch.float32 and not out["w"].any()
