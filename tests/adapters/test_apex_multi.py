"""Apex's deleted multiple models / optimizers / losses suite, re-created as behaviour tests.

Each model has a float32 and a float16 parameter; losses are sums of model outputs; SGD
with momentum and per-group learning rates. Every opt level x three ways of zeroing
grads x (two losses with ids [0, 1] or one scaler with ids [0, 0]); with a dynamic scale
an inf is injected into one grad inside one loss's context at one iteration. The run is
compared step by step with plain PyTorch that skips the same optimizers at the same
iteration: grads of the optimizers that step, final params, and ``model == master``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import Parameter

import fmp
from adapters.apex.amp import Amp

F16 = torch.float16


class MyModel(torch.nn.Module):
    def __init__(self, unique: float) -> None:
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = Parameter(1.0 + unique + torch.arange(2, dtype=F16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight0.float() * self.weight1.float()).sum()


# name: (number of models, models summed in each loss, optimizer groups [(model, lr)],
#        optimizers passed with each loss)
SCENARIOS = {
    "2models2losses1optimizer": (2, [[0], [1]], [[(0, 0.25), (1, 0.5)]], [[0], [0]]),
    "3models2losses1optimizer": (3, [[0, 2], [1, 2]], [[(0, 0.25), (1, 0.5), (2, 0.125)]],
                                 [[0], [0]]),
    "2models2losses2optimizers": (2, [[0], [1]], [[(0, 0.25)], [(1, 0.5)]], [[0], [1]]),
    "3models2losses2optimizers": (3, [[0, 2], [1]], [[(0, 0.25), (1, 0.5)], [(2, 0.125)]],
                                  [[0, 1], [0]]),
}

LEVELS = [("O0", None), ("O1", None), ("O2", None), ("O3", None), ("O4", None), ("O5", None),
          ("O4", "dynamic"), ("O5", "dynamic"), ("O2", 8.0)]


def _build(scenario, fused=False):
    n, _, groups, _ = SCENARIOS[scenario]
    models = [MyModel(i + 1) for i in range(n)]
    opts = [torch.optim.SGD([{"params": list(models[m].parameters()), "lr": lr}
                             for m, lr in g], momentum=0.125, fused=fused or None)
            for g in groups]
    return models, opts


def _zero(how, models, opts):
    if how == "none":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif how == "model":
        for m in models:
            m.zero_grad()
    else:
        for o in opts:
            o.zero_grad()


_REF_CACHE: dict = {}


def _reference(scenario, iters, skips):
    """Plain PyTorch; ``skips[i]`` is the set of optimizers not stepped at iteration i."""
    key = (scenario, iters, tuple(sorted((i, tuple(sorted(s))) for i, s in skips.items())))
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _reference_run(scenario, iters, skips)
    return _REF_CACHE[key]


def _reference_run(scenario, iters, skips):
    _, losses, _, _ = SCENARIOS[scenario]
    models, opts = _build(scenario)
    x = torch.ones(2)
    grads = []
    for i in range(iters):
        _zero("none", models, opts)
        for members in losses:
            sum(models[m](x) for m in members).backward()
        grads.append([[p.grad.clone() for g in o.param_groups for p in g["params"]]
                      for o in opts])
        for k, o in enumerate(opts):
            if k not in skips.get(i, ()):
                o.step()
    return grads, [[p.detach().clone() for g in o.param_groups for p in g["params"]]
                   for o in opts]


def _run_amp(scenario, level, loss_scale, how, multi, inject, fused=False):
    _, losses, _, loss_opts = SCENARIOS[scenario]
    inject_iter, loc, which = inject
    iters = 3 if inject_iter >= 0 else 2
    models, opts = _build(scenario, fused)
    amp = Amp()
    kwargs = {} if loss_scale is None else {"loss_scale": loss_scale}
    models, opts = amp.initialize(models, opts, opt_level=level, verbosity=0,
                                  cast_model_type=False, num_losses=2 if multi else 1,
                                  **kwargs)
    # Non-trivial scales per loss. A checkpoint cannot change a fixed scale (an error since
    # issue 14), so the fixed ones are set on the scalers directly.
    for scaler, value in zip(amp.loss_scalers, (4.0, 16.0), strict=False):
        if scaler.dynamic:
            scaler.load_state_dict({"loss_scale": value, "unskipped": 0})
        else:
            scaler.record, scaler.static_value = fmp.StaticLossScale(value), value
    loss_ids = [0, 1] if multi else [0, 0]
    skips = {inject_iter: set(loss_opts[which])} if inject_iter >= 0 else {}
    ref_grads, ref_final = _reference(scenario, iters, skips)
    x = torch.ones(2)
    for i in range(iters):
        _zero(how, models, opts)
        outs = [sum(models[m](x) for m in members) for members in losses]
        for k, loss in enumerate(outs):
            with amp.scale_loss(loss, [opts[j] for j in loss_opts[k]],
                                loss_id=loss_ids[k]) as scaled:
                scaled.backward()
                if i == inject_iter and k == which:
                    target = models[losses[k][0]]
                    p = target.weight0 if loc == "fp32" else target.weight1
                    p.grad[0] = float("inf")
        for k, o in enumerate(opts):
            if k in skips.get(i, ()):
                continue
            for p, r in zip(amp.master_params(o), ref_grads[i][k], strict=True):
                assert torch.equal(p.grad.float(), r.float()), (i, k)
        before = [[p.detach().clone() for p in amp.master_params(o)] for o in opts]
        state_before = [[{k: v.clone() for k, v in o.state[p].items()}
                         for p in amp.master_params(o)] for o in opts]
        for o in opts:
            o.step()
        for k, o in enumerate(opts):
            skipped = k in skips.get(i, ())
            assert amp.last_step_skipped(o) == skipped, (i, k)
            if skipped:
                for p, b, sb in zip(amp.master_params(o), before[k], state_before[k],
                                    strict=True):
                    assert torch.equal(p, b)
                    assert o.state[p].keys() == sb.keys()
                    for key in sb:
                        assert torch.equal(o.state[p][key], sb[key])
    for k, o in enumerate(opts):
        model_params = [p for m, _ in SCENARIOS[scenario][2][k] for p in models[m].parameters()]
        for model_p, master, ref in zip(model_params, amp.master_params(o), ref_final[k],
                                        strict=True):
            assert torch.allclose(model_p.float(), ref.float(), rtol=1e-3, atol=1e-3)
            assert torch.equal(model_p, master.to(model_p.dtype))
            if model_p.dtype == torch.float32 or master is model_p:
                assert torch.equal(model_p.float(), ref.float())
    return amp


def _injections(dynamic, scenario):
    yield (-1, None, 0)
    if dynamic:
        yield from itertools.product((0, 1), ("fp16", "fp32"), (0, 1))


@pytest.mark.parametrize("multi", [True, False], ids=["ids01", "ids00"])
@pytest.mark.parametrize("how", ["none", "model", "optimizer"])
@pytest.mark.parametrize("level,loss_scale", LEVELS, ids=[f"{a}-{b}" for a, b in LEVELS])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_multiple_models_optimizers_losses(scenario, level, loss_scale, how, multi):
    dynamic = loss_scale == "dynamic" or (loss_scale is None and level in ("O1", "O2"))
    for inject in _injections(dynamic, scenario):
        _run_amp(scenario, level, loss_scale, how, multi, inject)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fused_sgd_skips_on_device(scenario, level):
    for inject in _injections(True, scenario):
        _run_amp(scenario, level, None, "optimizer", True, inject, fused=True)


def test_overflow_in_loss_k_skips_only_its_optimizers():
    scenario = "2models2losses2optimizers"
    for which in (0, 1):
        amp = _run_amp(scenario, "O2", None, "optimizer", True, (1, "fp16", which))
        scales = [s.loss_scale.item() for s in amp.loss_scalers]
        expected = [4.0, 16.0]
        expected[which] /= 2
        assert scales == expected
