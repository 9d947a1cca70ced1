"""The functional train step: training, skips, purity, accumulation, compile, model state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, has_nan, mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmp


def make(policy="fp32", opt=None, loss_scale=None, seed=0, **step_kw):
    net = mlp(seed=seed)
    apply_fn, params, _ = fmp.functional(net)
    opt = opt or fmp.optim.adamw(1e-2)

    def loss_fn(p, x, y, factor):
        logits = apply_fn(p, x)
        logits = ScaleGrad.apply(logits, factor)
        return F.cross_entropy(logits.float(), y)

    step = fmp.train_step(loss_fn, opt, policy, **step_kw)
    params = fmp.get_policy(policy).cast_to_param(clone_tree(params))
    state = fmp.TrainState.create(params, opt, loss_scale)
    return step, state


ONE = torch.tensor(1.0)
INF = torch.tensor(float("inf"))
NAN = torch.tensor(float("nan"))


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed", "fp32", "bf16-true"])
def test_trains_to_a_clearly_lower_loss(policy):
    x, y = blobs()
    ls = fmp.DynamicLossScale.create() if "fp16" in policy else None
    step, state = make(policy, loss_scale=ls)
    losses = []
    for _ in range(30):
        state, m = step(state, x, y, ONE)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.25 * losses[0], losses
    assert int(state.skipped_total) == 0 and int(state.step) == 30
    assert state.params["0.weight"].dtype == fmp.get_policy(policy).param_dtype


def test_metrics_are_tensors_of_the_documented_dtypes():
    x, y = blobs(32)
    step, state = make("bf16-mixed", loss_scale=fmp.DynamicLossScale.create(initial=8.0))
    _, m = step(state, x, y, ONE)
    assert set(m) == {"loss", "grads_finite", "skipped", "loss_scale", "skipped_total"}
    assert m["loss"].dtype == torch.float32 and m["loss"].dim() == 0
    assert m["grads_finite"].dtype == torch.bool and m["skipped"].dtype == torch.bool
    assert m["loss_scale"].dtype == torch.float32 and float(m["loss_scale"]) == 8.0
    assert m["skipped_total"].dtype == torch.int32


def test_loss_is_unscaled():
    x, y = blobs(32)
    s1, st1 = make("fp32", loss_scale=fmp.StaticLossScale(1024.0))
    s2, st2 = make("fp32")
    _, m1 = s1(st1, x, y, ONE)
    _, m2 = s2(st2, x, y, ONE)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)


@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("poison", ["grad_inf", "grad_nan", "batch_inf", "batch_nan"])
def test_injected_overflow_skips_exactly_those_steps(policy, poison):
    x, y = blobs(64)
    step, state = make(policy, loss_scale=fmp.DynamicLossScale.create(initial=2.0**10))
    bad_steps = {2, 3, 7}
    applied = 0
    for i in range(10):
        xi, factor = x, ONE
        if i in bad_steps:
            if poison.startswith("grad"):
                factor = INF if poison.endswith("inf") else NAN
            else:
                xi = x.clone()
                xi[5, 1] = float("inf") if poison.endswith("inf") else float("nan")
        before = clone_tree(state)
        state, m = step(state, xi, y, factor)
        if i in bad_steps:
            assert bool(m["skipped"]) and not bool(m["grads_finite"])
            assert_trees_bit_equal(state.params, before.params)
            assert_trees_bit_equal(state.opt_state, before.opt_state)
            assert float(state.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2
        else:
            applied += 1
            assert not bool(m["skipped"])
            assert not torch.equal(state.params["0.weight"], before.params["0.weight"])
        assert not has_nan(state.params)
    assert int(state.skipped_total) == len(bad_steps)
    assert int(state.opt_state.count) == applied if hasattr(state.opt_state, "count") else True


def test_noop_loss_scale_still_skips_nan():
    x, y = blobs(32)
    step, state = make("bf16-mixed")
    before = clone_tree(state)
    state, m = step(state, x, y, NAN)
    assert bool(m["skipped"])
    assert_trees_bit_equal(state.params, before.params)


def test_step_is_pure():
    x, y = blobs(32)
    step, state = make("fp16-mixed", loss_scale=fmp.DynamicLossScale.create())
    for _ in range(2):
        state, _ = step(state, x, y, ONE)
    before = clone_tree(state)
    xb, yb = x.clone(), y.clone()
    step(state, x, y, ONE)
    assert_trees_bit_equal(state, before)
    assert torch.equal(x, xb) and torch.equal(y, yb)


@pytest.mark.parametrize("factor", [ONE, INF])
def test_donate_without_fused_kernel_is_bit_identical_to_pure(factor):
    # chain() has no fused kernel: donation is then the pure update written in place
    mk = lambda: fmp.optim.chain(fmp.optim.add_decayed_weights(0.01), fmp.optim.sgd(0.1))  # noqa: E731
    step_p, state_p = make("bf16-mixed", opt=mk(), loss_scale=fmp.DynamicLossScale.create())
    step_d, state_d = make("bf16-mixed", opt=mk(), loss_scale=fmp.DynamicLossScale.create(),
                           donate=True)
    x, y = blobs(32)
    for _ in range(2):
        state_p, _ = step_p(state_p, x, y, ONE)
        state_d, _ = step_d(state_d, x, y, ONE)
    w = state_d.params["0.weight"]
    state_p, _ = step_p(state_p, x, y, factor)
    state_d, _ = step_d(state_d, x, y, factor)
    assert state_d.params["0.weight"] is w
    assert_trees_bit_equal(state_p.params, state_d.params)
    assert_trees_bit_equal(state_p.opt_state, state_d.opt_state)


FUSED_OPTS = {
    "adamw": lambda: fmp.optim.adamw(1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda: fmp.optim.adam(1e-2, weight_decay=0.01, amsgrad=True),
    "adam_schedule": lambda: fmp.optim.adam(lambda c: 1e-2 / (1.0 + c.float())),
    "sgd_nesterov": lambda: fmp.optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_plain": lambda: fmp.optim.sgd(0.05),
}


def count_fused_calls(monkeypatch) -> list[int]:
    """A list that grows by one on each call of torch's fused optimizer kernels."""
    calls: list[int] = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _r=real, **k: (calls.append(1), _r(*a, **k))[1])
    return calls


def pure_and_donated(loss_fn, mk, params, *batch, steps=3):
    """The same steps with donate=False, then True: [(final params, skip flags)] for each."""
    out = []
    for donate in (False, True):
        o = mk()
        step = fmp.train_step(loss_fn, o, "fp32", donate=donate)
        state = fmp.TrainState.create(clone_tree(params), o,
                                      fmp.DynamicLossScale.create(initial=2.0**10))
        skipped = []
        for _ in range(steps):
            state, m = step(state, *batch)
            skipped.append(bool(m["skipped"]))
        out.append((state.params, skipped))
    return out


@pytest.mark.parametrize("opt", list(FUSED_OPTS))
@pytest.mark.parametrize(("policy", "scaled", "accumulate"),
                         [("fp16-mixed", True, 1), ("bf16-mixed", False, 1),
                          ("fp16-mixed", True, 2), ("fp32", False, 2)])
def test_donated_fused_kernel_matches_pure_path(opt, policy, scaled, accumulate, monkeypatch):
    calls = count_fused_calls(monkeypatch)
    mk = FUSED_OPTS[opt]
    ls = (lambda: fmp.DynamicLossScale.create(initial=2.0**10, period=2)) if scaled else (
        lambda: None)
    step_p, state_p = make(policy, opt=mk(), loss_scale=ls(), accumulate=accumulate)
    step_d, state_d = make(policy, opt=mk(), loss_scale=ls(), accumulate=accumulate,
                           donate=True)
    x, y = blobs(32)
    for i in range(6):
        f = INF if i in (2, 4) else ONE
        before = clone_tree(state_d)
        state_p, m_p = step_p(state_p, x, y, f)
        state_d, m_d = step_d(state_d, x, y, f)
        assert bool(m_d["skipped"]) == bool(m_p["skipped"]) == (i in (2, 4))
        assert float(m_d["loss_scale"]) == float(m_p["loss_scale"])
        if i in (2, 4):
            assert_trees_bit_equal(state_d.params, before.params)
            assert_trees_bit_equal(state_d.opt_state, before.opt_state)
        for k in state_p.params:
            # the kernel divides by the scale where the pure path multiplies by its
            # reciprocal: rounding-level differences, amplified a little by Adam's eps region
            torch.testing.assert_close(state_d.params[k], state_p.params[k], rtol=1e-4,
                                       atol=2e-5)
    assert int(state_d.opt_state.count) == int(state_p.opt_state.count) == 4
    assert len(calls) == 4 + 2  # the kernel runs on skipped steps too (and writes nothing)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_accumulation_equals_one_big_batch(opt):
    x, y = blobs(48)
    mk = (lambda: fmp.optim.sgd(0.1, momentum=0.9)) if opt == "sgd" else (
        lambda: fmp.optim.adamw(1e-2))
    big, sb = make("fp32", opt=mk())
    acc, sa = make("fp32", opt=mk(), accumulate=4)
    for _ in range(3):
        sb, mb = big(sb, x, y, ONE)
        sa, ma = acc(sa, x, y, ONE)
        assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=1e-5)
    for k in sb.params:
        torch.testing.assert_close(sa.params[k], sb.params[k], rtol=1e-5, atol=1e-6)


def test_accumulation_moves_the_scale_once_and_skips_on_any_bad_micro_batch():
    x, y = blobs(48)
    acc, state = make("fp16-mixed", loss_scale=fmp.DynamicLossScale.create(initial=64.0,
                                                                          period=1),
                      accumulate=3)
    state, m = acc(state, x, y, ONE)
    assert float(m["loss_scale"]) == 128.0  # one growth per step, not per micro-batch
    before = clone_tree(state)
    xb = x.clone()
    xb[40, 0] = float("inf")  # in the last micro-batch only
    state, m = acc(state, xb, y, ONE)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 64.0
    assert_trees_bit_equal(state.params, before.params)


def test_fp32_trajectory_equals_torch_optim():
    """fp32 policy + fmp adamw == nn.Module + torch.optim.AdamW, step by step."""
    x, y = blobs(64)
    net = mlp(seed=3)
    ref = mlp(seed=3)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.adamw(1e-2, weight_decay=0.1)
    step = fmp.train_step(lambda p, a, b: F.cross_entropy(apply_fn(p, a), b), opt, "fp32")
    state = fmp.TrainState.create(clone_tree(params), opt)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        state, m = step(state, x, y)
        topt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        topt.step()
        assert float(m["loss"]) == pytest.approx(loss.item(), rel=1e-5)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(state.params[n], p.detach(), rtol=1e-5, atol=1e-6)


def test_fp16_scale_trajectory_and_skips_equal_gradscaler():
    """fmp fp16 step (autocast) and torch.autocast + GradScaler agree on every skip and scale."""
    x, y = blobs(64)
    bad = {1, 4, 5, 9}
    net, ref = mlp(seed=4), mlp(seed=4)
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    opt = fmp.optim.sgd(0.05)
    step = fmp.train_step(loss_fn, opt, "fp16-mixed", autocast=True)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=256.0, period=3))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    topt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for i in range(12):
        f = INF if i in bad else ONE
        state, m = step(state, x, y, f)
        topt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ScaleGrad.apply(ref(x), f)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(topt)
        scaler.update()
        assert bool(m["skipped"]) == (i in bad)
        assert float(m["loss_scale"]) == scaler.get_scale()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(state.params[n], p.detach(), rtol=1e-2, atol=1e-3)


@given(st.lists(st.booleans(), min_size=1, max_size=12))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_random_skip_patterns(pattern):
    x, y = blobs(16)
    step, state = make("fp16-mixed", opt=fmp.optim.adam(1e-2),
                       loss_scale=fmp.DynamicLossScale.create(initial=2.0**8, period=2))
    for bad in pattern:
        state, m = step(state, x, y, NAN if bad else ONE)
        assert bool(m["skipped"]) == bad
        assert not has_nan(state.params) and not has_nan(state.opt_state)
    assert int(state.opt_state.count) == pattern.count(False)
    assert int(state.skipped_total) == pattern.count(True)
    assert int(state.step) == len(pattern)


def test_model_state_batchnorm():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                              torch.nn.ReLU(), torch.nn.Linear(16, 2))
    apply_fn, params, buffers = fmp.functional(net)
    pol = fmp.module_policies(net, "bf16-mixed", {torch.nn.BatchNorm1d: "fp32"})

    def loss_fn(p, ms, a, b, f):
        out, new_ms = apply_fn(p, a, buffers=ms, return_buffers=True)
        return F.cross_entropy(ScaleGrad.apply(out, f).float(), b), new_ms

    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(loss_fn, opt, "bf16-mixed", has_state=True, param_policies=pol)
    caller_buffers = clone_tree(buffers)
    state = fmp.TrainState.create(clone_tree(params), opt, model_state=clone_tree(buffers))
    x, y = blobs(32)
    state, _ = step(state, x, y, ONE)
    assert not torch.equal(state.model_state["1.running_mean"], caller_buffers["1.running_mean"])
    assert int(state.model_state["1.num_batches_tracked"]) == 1
    assert_trees_bit_equal(buffers, caller_buffers)  # the module's own buffers untouched
    before = clone_tree(state)
    xb = x.clone()
    xb[0, 0] = float("nan")
    state, m = step(state, xb, y, ONE)
    assert bool(m["skipped"])
    assert_trees_bit_equal(state.model_state, before.model_state)


def test_has_aux():
    net = mlp()
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, a, b):
        logits = apply_fn(p, a)
        return F.cross_entropy(logits.float(), b), {"acc": (logits.argmax(-1) == b).float().mean()}

    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(loss_fn, opt, "bf16-mixed", has_aux=True)
    state = fmp.TrainState.create(params, opt)
    _, m = step(state, *blobs(32))
    assert 0.0 <= float(m["aux"]["acc"]) <= 1.0


def test_value_and_grad_matches_autograd_and_casts():
    net = mlp()
    apply_fn, params, _ = fmp.functional(net)
    x, y = blobs(16)
    seen = {}

    def loss_fn(p, a, b):
        seen["param"] = p["0.weight"].dtype
        seen["input"] = a.dtype
        seen["label"] = b.dtype
        return F.cross_entropy(apply_fn(p, a).float(), b)

    vg = fmp.value_and_grad(loss_fn, "fp32")
    loss, grads, finite = vg(params, fmp.StaticLossScale(128.0), x, y)
    ref = F.cross_entropy(net(x), y)
    ref.backward()
    assert float(loss) == pytest.approx(ref.item(), rel=1e-6)
    for n, p in net.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
    assert bool(finite)
    fmp.value_and_grad(loss_fn, "bf16-mixed")(params, fmp.NoOpLossScale(), x, y)
    assert seen == {"param": torch.bfloat16, "input": torch.bfloat16, "label": torch.int64}
    (_, aux), grads, _ = fmp.value_and_grad(lambda p, a, b: (loss_fn(p, a, b), 7),
                                               "bf16-mixed", has_aux=True)(
        params, fmp.NoOpLossScale(), x, y)
    assert aux == 7 and grads["0.weight"].dtype == torch.float32


def test_bad_input_errors():
    opt = fmp.optim.sgd(0.1)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1, got 0"):
        fmp.train_step(lambda p: p, opt, accumulate=0)
    with pytest.raises(ValueError, match=r"got 2\.5"):
        fmp.train_step(lambda p: p, opt, accumulate=2.5)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fmp.train_step(lambda p: p, torch.optim.SGD)
    with pytest.raises(ValueError, match="'bf17'"):
        fmp.train_step(lambda p: p, opt, "c=bf17")
    with pytest.raises(TypeError, match="loss_scale"):
        fmp.TrainState.create({"w": torch.ones(1)}, opt, loss_scale=2.0)
    _, bf16_state = make("bf16-true")
    with pytest.raises(ValueError, match=r"param '0\.(weight|bias)' is torch.bfloat16 but"):
        fmp.train_step(lambda p, *b: p["0.bias"].sum(), opt, "fp32")(bf16_state, *blobs(8), ONE)
    step, state = make(accumulate=3)
    with pytest.raises(ValueError, match="leading size 32, which is not divisible by 3"):
        step(state, *blobs(32), ONE)
    vg = fmp.value_and_grad(lambda p: p["w"] * 2)
    with pytest.raises(ValueError, match=r"0-d floating tensor.*shape \(3,\)"):
        vg({"w": torch.ones(3)}, fmp.NoOpLossScale())


def test_functional_apply_and_buffers():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    apply_fn, params, buffers = fmp.functional(net)
    x = torch.randn(4, 3)
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    b0 = clone_tree(buffers)
    out, nb = apply_fn(params, x, buffers=buffers, return_buffers=True)
    assert_trees_bit_equal(buffers, b0)
    assert not torch.equal(nb["1.running_mean"], b0["1.running_mean"])
    torch.testing.assert_close(out, net(x))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fmp.functional(lambda v: v)


def test_tied_weights_stay_tied():
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    net = torch.nn.Sequential(emb, head)
    apply_fn, params, _ = fmp.functional(net)
    assert list(params) == ["0.weight"]
    new = {"0.weight": torch.zeros(5, 4)}
    assert torch.equal(apply_fn(new, torch.tensor([1, 2])), torch.zeros(2, 5))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_donated_step_with_a_grad_shared_by_two_params(opt):
    """autograd hands one grad tensor to both inputs of an add: it must be unscaled once."""
    mk = (lambda: fmp.optim.sgd(0.1)) if opt == "sgd" else (lambda: fmp.optim.adamw(1e-2))
    x = torch.randn(4, 4)

    def loss_fn(p, a):
        return ((p["a"] + p["b"]) @ a).square().mean()

    params = {"a": torch.randn(3, 4), "b": torch.randn(3, 4)}
    (pure, _), (donated, _) = pure_and_donated(loss_fn, mk, params, x)
    for k in params:
        torch.testing.assert_close(donated[k], pure[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
def test_donated_fused_kernel_on_channels_last_params(opt, monkeypatch):
    """ResNets train channels-last: their grads keep that layout and take the fused path."""
    calls = count_fused_calls(monkeypatch)
    mk = (lambda: fmp.optim.sgd(0.05, momentum=0.9)) if opt == "sgd_momentum" else (
        lambda: fmp.optim.adamw(1e-2))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 6 * 6, 2)).to(memory_format=torch.channels_last)
    apply_fn, params, _ = fmp.functional(net)
    assert params["0.weight"].is_contiguous(memory_format=torch.channels_last)
    assert not params["0.weight"].is_contiguous()

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(apply_fn(p, x).float(), y)

    x = torch.randn(8, 3, 8, 8).to(memory_format=torch.channels_last)
    y = torch.randint(0, 2, (8,))
    (pure, skipped_p), (donated, skipped_d) = pure_and_donated(loss_fn, mk, params, x, y)
    assert skipped_p == skipped_d == [False] * 3
    assert len(calls) == 3
    for k in params:
        torch.testing.assert_close(donated[k], pure[k], rtol=1e-5, atol=1e-6)


def test_fused_step_refuses_grads_laid_out_unlike_their_params():
    from fmp.optim import update_in_place

    o = fmp.optim.sgd(0.1, momentum=0.9)
    p = {"w": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)}
    state = o.init(p)
    g = {"w": torch.randn(2, 3, 4, 4)}
    before = clone_tree((p, state))
    assert update_in_place(o, p, g, state, None, torch.zeros(())) is None
    assert_trees_bit_equal((p, state), before)


def test_check_and_unscale_owned_refuses_aliases_and_views():
    from fmp.loss_scale._inplace import check_and_unscale_owned_

    g = torch.ones(4)
    inv = torch.tensor(0.5)
    assert check_and_unscale_owned_([g, g], inv) is None and torch.equal(g, torch.ones(4))
    base = torch.ones(8)
    assert check_and_unscale_owned_([base[:4]], inv) is None
    assert check_and_unscale_owned_([torch.ones(1).expand(4)], inv) is None
    a, b = torch.ones(4), torch.tensor([1.0, float("inf")])
    finite = check_and_unscale_owned_([a, b], inv)
    assert finite is not None and not bool(finite) and torch.equal(a, torch.full((4,), 0.5))


class _GradIsInput(torch.autograd.Function):
    """A custom Function whose backward hands back a tensor the caller holds."""

    @staticmethod
    def forward(w, x):
        return (w * x).sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x, None


@pytest.mark.parametrize("donate", [False, True])
def test_step_never_writes_into_a_batch_tensor_returned_as_a_grad(donate):
    x = torch.randn(5)
    x0 = x.clone()
    opt = fmp.optim.sgd(0.1)
    step = fmp.train_step(lambda p, a: _GradIsInput.apply(p["w"], a), opt, "fp32",
                          donate=donate)
    state = fmp.TrainState.create({"w": torch.zeros(5)}, opt,
                                  fmp.DynamicLossScale.create(initial=8.0))
    state, _ = step(state, x)
    assert torch.equal(x, x0)  # the unscale did not happen in the caller's tensor
    # the backward ignores the (scaled) incoming grad, so the step divides x by the scale
    torch.testing.assert_close(state.params["w"], -0.1 * x0 / 8.0)
