"""fmp.optim's in-place fused form (update_in_place / in_place_supported) and who has it.

torch's fused CPU kernels round a few operations differently from the foreach path (a
fused multiply-add, another order in the Adam denominator), so the in-place result is
compared bit for bit with its peer, ``torch.optim.*(fused=True)``, and within a few ulps
with ``update`` + ``apply_updates``. Skips, refusals and the state it returns are exact.
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import assert_trees_bit_equal, clone_tree

import fmp
import fmp.optim as fo

SHAPES = [(5, 3), (7,), (2, 3, 2, 2)]
STEPS = 5


def pow2_schedule(count):
    """2**-(count + 5): the same number in float32 (ours) and float64 (torch's scheduler)."""
    return torch.exp2(-(count.float() + 5.0))


# name: (fmp optimizer, torch class, torch kwargs, torch LambdaLR factor or None)
CASES = {
    "sgd": (lambda: fo.sgd(0.05), torch.optim.SGD, dict(lr=0.05), None),
    "sgd_momentum": (lambda: fo.sgd(0.05, momentum=0.9), torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9), None),
    "sgd_nesterov_wd": (lambda: fo.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                        torch.optim.SGD,
                        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), None),
    "adam": (lambda: fo.adam(1e-2), torch.optim.Adam, dict(lr=1e-2), None),
    "adam_wd_amsgrad": (lambda: fo.adam(1e-2, weight_decay=0.1, amsgrad=True), torch.optim.Adam,
                        dict(lr=1e-2, weight_decay=0.1, amsgrad=True), None),
    "adamw": (lambda: fo.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1), torch.optim.AdamW,
              dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1), None),
    "adamw_amsgrad_schedule": (lambda: fo.adamw(pow2_schedule, weight_decay=0.1, amsgrad=True),
                               torch.optim.AdamW,
                               dict(lr=2.0**-5, weight_decay=0.1, amsgrad=True),
                               lambda k: 2.0**-k),
}


def make(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(s, generator=gen).to(dtype) for i, s in enumerate(SHAPES)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()}
             for _ in range(STEPS)]
    return params, grads


def moments(state):
    """The moment trees of an sgd / adam state, in torch's order (its state keys)."""
    if isinstance(state, fo.SgdState):
        return {} if state.momentum is None else {"momentum_buffer": state.momentum}
    out = {"exp_avg": state.mu, "exp_avg_sq": state.nu}
    if state.nu_max is not None:
        out["max_exp_avg_sq"] = state.nu_max
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_in_place_matches_torch_fused_bit_for_bit(case):
    mk, cls, kwargs, factor = CASES[case]
    opt = mk()
    params, grads = make()
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    topt = cls(ref, fused=True, **kwargs)
    sched = None if factor is None else torch.optim.lr_scheduler.LambdaLR(topt, factor)
    state = opt.init(params)
    for k, g in enumerate(grads):
        assert fo.in_place_supported(opt, params, g, state)
        new = fo.update_in_place(opt, params, g, state, None, torch.zeros(()))
        assert new.count.item() == k + 1 and new.count.dtype == torch.int32
        for name, tree in moments(new).items():  # the same tensors, written in place
            assert all(a is b for a, b in zip(optree.tree_leaves(tree),
                                              optree.tree_leaves(moments(state)[name]),
                                              strict=True))
        state = new
        for p, gg in zip(ref, g.values(), strict=True):
            p.grad = gg.clone()
        topt.step()
        if sched is not None:
            sched.step()
        for p, ours in zip(ref, params.values(), strict=True):
            assert_trees_bit_equal(ours, p.detach())
        for name, tree in moments(state).items():
            theirs = [topt.state[p][name] for p in ref]
            assert_trees_bit_equal(optree.tree_leaves(tree), theirs)


@pytest.mark.parametrize("case", list(CASES))
def test_in_place_matches_pure_update_and_apply_updates(case):
    opt = CASES[case][0]()
    params, grads = make(seed=1)
    pure_p, pure_s = clone_tree(params), opt.init(params)
    state = opt.init(params)
    for g in grads:
        u, pure_s = opt.update(g, pure_s, pure_p)
        pure_p = fo.apply_updates(pure_p, u)
        state = fo.update_in_place(opt, params, g, state, None, torch.zeros(()))
        assert optree.tree_structure(state) == optree.tree_structure(pure_s)
        assert torch.equal(state.count, pure_s.count)
        for a, b in zip(optree.tree_leaves((params, state)), optree.tree_leaves((pure_p, pure_s)),
                        strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_grad_scale_divides_exactly(case):
    """Grads multiplied by 2**10 and divided on the way give the unscaled result exactly."""
    opt = CASES[case][0]()
    params, grads = make(seed=2)
    scaled_p, state, scaled_s = clone_tree(params), opt.init(params), opt.init(params)
    scale = torch.tensor(1024.0)
    for g in grads:
        state = fo.update_in_place(opt, params, g, state, None, torch.zeros(()))
        gs = {k: v * 1024.0 for k, v in g.items()}
        scaled_s = fo.update_in_place(opt, scaled_p, gs, scaled_s, scale, torch.zeros(()))
    assert_trees_bit_equal((scaled_p, scaled_s), (params, state))


@pytest.mark.parametrize("case", list(CASES))
def test_found_inf_leaves_everything_bit_identical(case):
    opt = CASES[case][0]()
    params, grads = make(seed=3)
    state = opt.init(params)
    state = fo.update_in_place(opt, params, grads[0], state, None, torch.zeros(()))
    g = grads[1]
    g["p0"][0, 0] = float("inf")
    before = clone_tree((params, state, g))
    new = fo.update_in_place(opt, params, g, state, torch.tensor(8.0), torch.ones(()))
    assert_trees_bit_equal((params, new, g), before)  # the count does not move either


def bf16_uniform():
    p = {"w": torch.randn(3, 2, dtype=torch.bfloat16)}
    return fo.adamw(1e-2, state_dtype=None), p, {"w": torch.randn(3, 2, dtype=torch.bfloat16)}


def test_bf16_uniform_tree_is_supported():
    opt, p, g = bf16_uniform()
    state = opt.init(p)
    assert fo.in_place_supported(opt, p, g, state)
    assert fo.update_in_place(opt, p, g, state, None, torch.zeros(())) is not None


def _unsupported():
    """(label, optimizer, params, grads, state) that update_in_place must refuse."""
    f32 = {"w": torch.randn(2, 3, 4, 4), "b": torch.randn(3)}
    g32 = {k: torch.randn(v.shape) for k, v in f32.items()}
    sgd = fo.sgd(0.1, momentum=0.9)
    adam = fo.adam(1e-2)
    ams = fo.adam(1e-2, amsgrad=True)
    mixed = {"w": f32["w"], "b": f32["b"].to(torch.bfloat16)}
    mixed_g = {"w": g32["w"], "b": g32["b"].to(torch.bfloat16)}
    bf16 = {k: v.to(torch.bfloat16) for k, v in f32.items()}
    bf16_g = {k: v.to(torch.bfloat16) for k, v in g32.items()}
    cl = {"w": f32["w"].to(memory_format=torch.channels_last), "b": f32["b"]}
    plain = fo.GradientTransformation(sgd.init, lambda g, s, p=None: sgd.update(g, s, p))
    damp = fo.sgd(0.1, momentum=0.9, dampening=0.1)
    yield "mixed param dtypes", adam, mixed, mixed_g, adam.init(mixed)
    yield "bf16 params, f32 moments", adam, bf16, bf16_g, adam.init(bf16)
    yield "f64 grads", sgd, f32, {k: v.double() for k, v in g32.items()}, sgd.init(f32)
    yield "grads laid out unlike params", sgd, cl, g32, sgd.init(cl)
    yield "moments laid out unlike params", adam, cl, {"w": g32["w"].to(
        memory_format=torch.channels_last), "b": g32["b"]}, adam.init(f32)
    yield "grads of another structure", adam, f32, {"w": g32["w"]}, adam.init(f32)
    yield "dampening", damp, f32, g32, damp.init(f32)
    yield "state of another optimizer", sgd, f32, g32, adam.init(f32)
    yield "amsgrad without nu_max", ams, f32, g32, adam.init(f32)
    yield "no leaves", adam, {}, {}, adam.init({})
    yield "plain update function", plain, f32, g32, sgd.init(f32)
    chained = fo.chain(fo.add_decayed_weights(0.01), sgd)
    yield "chain of two", chained, f32, g32, chained.init(f32)
    for t in (fo.scale(0.5), fo.scale_by_learning_rate(0.1), fo.trace(0.9),
              fo.scale_by_adam(), fo.add_decayed_weights(0.1)):
        yield f"block {t.update!r}", t, f32, g32, t.init(f32)


UNSUPPORTED = list(_unsupported())


@pytest.mark.parametrize("label", [u[0] for u in UNSUPPORTED])
def test_unsupported_returns_none_and_touches_nothing(label):
    _, opt, params, grads, state = next(u for u in UNSUPPORTED if u[0] == label)
    before = clone_tree((params, grads, state))
    assert not fo.in_place_supported(opt, params, grads, state)
    assert fo.update_in_place(opt, params, grads, state, torch.tensor(2.0),
                              torch.zeros(())) is None
    assert_trees_bit_equal((params, grads, state), before)


def test_not_in_eager_mode_returns_none(monkeypatch):
    """Under torch.compile (or a torch.func transform) the pure path is the one to trace."""
    opt = fo.sgd(0.1)
    p, g = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    state = opt.init(p)
    assert fo.in_place_supported(opt, p, g, state)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fo.in_place_supported(opt, p, g, state)
    assert fo.update_in_place(opt, p, g, state, None, torch.zeros(())) is None
    assert p["w"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ the chain rule


@pytest.mark.parametrize("case", ["sgd_nesterov_wd", "adamw_amsgrad_schedule"])
def test_chain_of_one_keeps_the_in_place_form(case):
    opt = CASES[case][0]()
    for wrapped in (fo.chain(opt), fo.chain(fo.chain(opt))):
        params, grads = make(seed=4)
        alone_p, alone_s = clone_tree(params), opt.init(params)
        state = wrapped.init(params)
        for g in grads:
            assert fo.in_place_supported(wrapped, params, g, state)
            state = fo.update_in_place(wrapped, params, g, state, None, torch.zeros(()))
            alone_s = fo.update_in_place(opt, alone_p, g, alone_s, None, torch.zeros(()))
            inner = state
            while type(inner) is tuple:
                inner = inner[0]
            assert_trees_bit_equal((params, inner), (alone_p, alone_s))
        assert optree.tree_structure(state) == optree.tree_structure(wrapped.init(params))
        # a state not shaped like the chain's (the bare optimizer's) is refused, untouched
        bare = opt.init(params)
        before = clone_tree((params, bare))
        assert fo.update_in_place(wrapped, params, grads[0], bare, None, torch.zeros(())) is None
        assert_trees_bit_equal((params, bare), before)


def test_chain_combines_the_schedule_checks_of_its_parts():
    ok = fo.chain(fo.sgd(lambda c: 0.1), fo.scale_by_learning_rate(lambda c: 1.0 - c.float()))
    s = ok.init({"w": torch.ones(1)})
    assert fo.schedule_ok(ok, s).item() is True
    s = (s[0], s[1]._replace(count=torch.tensor(2, dtype=torch.int32)))  # rate -1.0
    assert fo.schedule_ok(ok, s).item() is False
    assert fo.schedule_ok(fo.chain(fo.sgd(0.1), fo.scale(1.0)), s) is None
    assert fo.schedule_ok(fo.chain(fo.sgd(lambda c: float("nan"))), (s[0],)).item() is False


def test_train_step_donated_chain_of_one_uses_the_fused_kernel(monkeypatch):
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    model = torch.nn.Linear(4, 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p, x, y):
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for opt, n in ((fo.chain(fo.adamw(1e-2)), 2),
                   (fo.chain(fo.adamw(1e-2), fo.scale(1.0)), 0)):
        calls.clear()
        step = fmp.train_step(loss_fn, opt, "fp32", donate=True)
        state = fmp.TrainState.create(clone_tree(params), opt)
        for _ in range(2):
            state, m = step(state, x, y)
            assert not m["skipped"]
        assert len(calls) == n


# ------------------------------------------------------------------ the record


def test_gradient_transformation_has_optax_fields_only():
    assert fo.GradientTransformation._fields == ("init", "update")
    opt = fo.sgd(0.1)
    init, update = opt  # unpacks as optax's pair
    t = fo.GradientTransformation(init, update)
    assert t == opt and fo.in_place_supported(t, {"w": torch.ones(1)}, {"w": torch.ones(1)},
                                              init({"w": torch.ones(1)}))
    with pytest.raises(TypeError):
        fo.GradientTransformation(init, update, None)  # no third field any more
    assert "sgd" in repr(opt.update)


def test_state_records_pickle_under_the_public_module():
    """Checkpoints written before fmp.optim became a package name fmp.optim.AdamState."""
    import io
    import pickle

    state = fo.adam(amsgrad=True).init({"w": torch.ones(2)})
    blob = pickle.dumps(state)
    assert b"fmp.optim" in blob and b"_states" not in blob
    for cls in (fo.EmptyState, fo.SgdState, fo.AdamState, fo.TraceState,
                fo.ScaleByScheduleState):
        assert cls.__module__ == "fmp.optim"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back) is fo.AdamState
    assert_trees_bit_equal(back, state)
