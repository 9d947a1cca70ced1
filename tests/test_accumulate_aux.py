"""has_aux with accumulate=k: metrics["aux"] holds every micro-batch's aux, stacked."""

import torch
import torch.nn.functional as F

import fmp
from tests.helpers import blobs, mlp


def _loss_fn(apply_fn):
    def loss_fn(p, x, y):
        logits = apply_fn(p, x)
        aux = {"loss_i": F.cross_entropy(logits.float(), y, reduction="none"),
               "n": x.shape[0], "first_y": y[0], "none": None}
        return F.cross_entropy(logits.float(), y), aux
    return loss_fn


def test_aux_is_stacked_over_micro_batches_in_order():
    apply_fn, params, _ = fmp.functional(mlp())
    x, y = blobs(32)
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(_loss_fn(apply_fn), opt, "fp32", accumulate=4, has_aux=True)
    state = fmp.TrainState.create(params, opt)
    _, m = step(state, x, y)
    aux = m["aux"]
    assert aux["loss_i"].shape == (4, 8)
    assert aux["n"] == (8, 8, 8, 8)
    assert aux["none"] is None
    torch.testing.assert_close(aux["first_y"], y[::8])
    # each row is that micro-batch's per-example losses at the step's (old) params
    ref = F.cross_entropy(apply_fn(params, x), y, reduction="none").reshape(4, 8)
    torch.testing.assert_close(aux["loss_i"], ref)
    torch.testing.assert_close(aux["loss_i"].mean(), m["loss"])


def test_aux_without_accumulation_is_unchanged():
    apply_fn, params, _ = fmp.functional(mlp())
    x, y = blobs(32)
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(_loss_fn(apply_fn), opt, "fp32", has_aux=True)
    _, m = step(fmp.TrainState.create(params, opt), x, y)
    assert m["aux"]["loss_i"].shape == (32,) and m["aux"]["n"] == 32
