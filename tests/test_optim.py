"""fmp.optim against torch.optim, step by step; dtypes, purity, chain, compile, errors."""

from __future__ import annotations

import math
import re

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fmp.optim as fo

STEPS = 20
SHAPES = {"enc": {"w": (5, 3), "b": (5,)}, "dec": [(2, 5), ()], "head": (7, 1, 2)}


def make_params(dtype: torch.dtype = torch.float32, shapes=SHAPES, frozen: bool = True):
    """A small model's params dict (nested, several shapes, a None entry)."""
    params = optree.tree_map(lambda s: torch.randn(s, dtype=torch.float64).to(dtype), shapes,
                             is_leaf=lambda x: isinstance(x, tuple))
    if frozen:
        params["frozen"] = None
    return params


def make_grads(params, steps: int = STEPS, scale: float = 1.0):
    return [optree.tree_map(lambda p: scale * torch.randn_like(p), params) for _ in range(steps)]


def clone(tree):
    return optree.tree_map(torch.clone, tree)


def torch_run(cls, kwargs, params, grads, lr_lambda=None, lr_at=None):
    """Run torch.optim ``cls`` on copies of ``params``; the flattened params after each step."""
    leaves = [p.detach().clone().requires_grad_(True) for p in optree.tree_leaves(params)]
    opt = cls(leaves, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    history = []
    for k, g in enumerate(grads):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(k)
        for p, gl in zip(leaves, optree.tree_leaves(g), strict=True):
            p.grad = gl.clone()
        opt.step()
        if sched is not None:
            sched.step()
        history.append([p.detach().clone() for p in leaves])
    return history, opt, leaves


def fmp_run(opt, params, grads):
    state = opt.init(params)
    history = []
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = fo.apply_updates(params, updates)
        history.append(params)
    return history, state


def assert_history_close(ours, theirs, atol=1e-6, rtol=1e-6, scaled=False):
    """Step-by-step closeness; ``scaled`` makes atol relative to each tensor's max |value|."""
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        la = optree.tree_leaves(a)
        assert len(la) == len(b)
        for x, y in zip(la, b, strict=True):
            assert x.dtype == y.dtype
            tol = atol * max(1.0, y.abs().max().item()) if scaled else atol
            torch.testing.assert_close(x, y, atol=tol, rtol=rtol,
                                       msg=lambda m, k=k: f"step {k}: {m}")


FOREACH = [False, True, None]

SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.8, dampening=0.3),
    dict(lr=0.1, weight_decay=0.01),
    dict(lr=0.03, momentum=0.9, nesterov=True, weight_decay=0.1),
    dict(lr=0.03, momentum=0.5, dampening=0.5, weight_decay=0.05),
]

ADAM_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=0.1, betas=(0.5, 0.9), eps=1e-6),
    dict(lr=1e-2, betas=(0.0, 0.99)),
    dict(lr=1e-2, amsgrad=True, weight_decay=0.05),
]

ADAMW_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.3),
    dict(lr=1e-2, amsgrad=True),
]


# ------------------------------------------------------------------ torch.optim parity


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("kwargs", SGD_CASES, ids=str)
def test_sgd_matches_torch(kwargs, foreach):
    params = make_params()
    grads = make_grads(params)
    theirs, topt, leaves = torch_run(torch.optim.SGD, {**kwargs, "foreach": foreach}, params, grads)
    ours, state = fmp_run(fo.sgd(**kwargs), params, grads)
    assert_history_close(ours, theirs)
    assert state.count.dtype == torch.int32 and int(state.count) == STEPS
    if kwargs.get("momentum", 0.0):
        for buf, p in zip(optree.tree_leaves(state.momentum), leaves, strict=True):
            torch.testing.assert_close(buf, topt.state[p]["momentum_buffer"], atol=1e-6, rtol=1e-6)
    else:
        assert state.momentum is None


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("kwargs", ADAM_CASES, ids=str)
def test_adam_matches_torch(kwargs, foreach):
    params = make_params()
    grads = make_grads(params)
    theirs, topt, leaves = torch_run(torch.optim.Adam, {**kwargs, "foreach": foreach}, params,
                                     grads)
    ours, state = fmp_run(fo.adam(**kwargs), params, grads)
    assert_history_close(ours, theirs)
    assert int(state.count) == STEPS
    for mu, nu, p in zip(optree.tree_leaves(state.mu), optree.tree_leaves(state.nu), leaves,
                         strict=True):
        torch.testing.assert_close(mu, topt.state[p]["exp_avg"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(nu, topt.state[p]["exp_avg_sq"], atol=1e-6, rtol=1e-6)
    if kwargs.get("amsgrad"):
        for m, p in zip(optree.tree_leaves(state.nu_max), leaves, strict=True):
            torch.testing.assert_close(m, topt.state[p]["max_exp_avg_sq"], atol=1e-6, rtol=1e-6)
    else:
        assert state.nu_max is None


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("kwargs", ADAMW_CASES, ids=str)
def test_adamw_matches_torch(kwargs, foreach):
    params = make_params()
    grads = make_grads(params)
    theirs, _, _ = torch_run(torch.optim.AdamW, {**kwargs, "foreach": foreach}, params, grads)
    ours, _ = fmp_run(fo.adamw(**kwargs), params, grads)
    assert_history_close(ours, theirs)


def test_adamw_default_weight_decay_is_torch_default():
    params = make_params()
    grads = make_grads(params, steps=5)
    theirs, _, _ = torch_run(torch.optim.AdamW, {}, params, grads)
    ours, _ = fmp_run(fo.adamw(), params, grads)
    assert_history_close(ours, theirs)


def test_large_values_close_relatively():
    params = make_params(frozen=False)
    params = optree.tree_map(lambda p: 1e4 * p, params)
    grads = make_grads(params, steps=10, scale=1e3)
    theirs, _, _ = torch_run(torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01),
                             params, grads)
    ours, _ = fmp_run(fo.sgd(0.1, momentum=0.9, weight_decay=0.01), params, grads)
    # torch fuses p + (-lr) * g; fmp rounds the update first: half an ulp of ~1e3
    assert_history_close(ours, theirs, atol=1e-6, rtol=1e-6, scaled=True)


def test_float64_params_keep_float64_with_state_dtype_none():
    params = make_params(torch.float64)
    grads = make_grads(params, steps=5)
    theirs, _, _ = torch_run(torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), params, grads)
    ours, state = fmp_run(fo.adam(1e-2, weight_decay=0.1, state_dtype=None), params, grads)
    assert_history_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert {x.dtype for x in optree.tree_leaves(state.mu)} == {torch.float64}


# ------------------------------------------------------------------ schedules


def exp_decay(count):
    return 0.1 * 0.9 ** count.to(torch.float32)


@pytest.mark.parametrize(
    ("make", "cls", "kwargs"),
    [
        (fo.sgd, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
        (fo.adam, torch.optim.Adam, dict(weight_decay=0.01)),
        (fo.adamw, torch.optim.AdamW, dict(weight_decay=0.1)),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_schedule_matches_lambda_lr(make, cls, kwargs):
    params = make_params()
    grads = make_grads(params)
    theirs, _, _ = torch_run(cls, dict(lr=0.1, **kwargs), params, grads,
                             lr_lambda=lambda k: 0.9**k)
    ours, _ = fmp_run(make(exp_decay, **kwargs), params, grads)
    assert_history_close(ours, theirs)


def test_piecewise_schedule_matches_manual_lr_change():
    def piecewise(count):
        return torch.where(count < 7, 0.05, torch.where(count < 14, 0.02, 0.005))

    params = make_params()
    grads = make_grads(params)
    theirs, _, _ = torch_run(torch.optim.AdamW, dict(lr=0.05, weight_decay=0.2), params, grads,
                             lr_at=lambda k: 0.05 if k < 7 else (0.02 if k < 14 else 0.005))
    ours, _ = fmp_run(fo.adamw(piecewise, weight_decay=0.2), params, grads)
    assert_history_close(ours, theirs)


def test_schedule_sees_count_of_previous_updates():
    seen = []

    def sched(count):
        seen.append(int(count))
        return 0.1

    opt = fo.sgd(sched)
    params = make_params()
    fmp_run(opt, params, make_grads(params, steps=4))
    assert seen == [0, 1, 2, 3]


def test_scale_by_learning_rate_schedule_state():
    t = fo.scale_by_learning_rate(lambda c: 2.0 ** c.to(torch.float32))
    params = {"w": torch.ones(3)}
    s = t.init(params)
    assert isinstance(s, fo.ScaleByScheduleState)
    outs = []
    for _ in range(3):
        u, s = t.update({"w": torch.ones(3)}, s)
        outs.append(u["w"][0].item())
    assert outs == [-1.0, -2.0, -4.0]
    assert int(s.count) == 3
    u, _ = fo.scale_by_learning_rate(0.5, flip_sign=False).update({"w": torch.ones(1)},
                                                                  fo.EmptyState())
    assert u["w"].item() == 0.5


# ------------------------------------------------------------------ dtypes


def tree_dtypes(tree):
    return {x.dtype for x in optree.tree_leaves(tree)}


@pytest.mark.parametrize("make", [fo.adam, fo.adamw], ids=["adam", "adamw"])
def test_bf16_params_default_state_is_float32(make):
    params = make_params(torch.bfloat16)
    opt = make(1e-2, amsgrad=True)
    state = opt.init(params)
    assert tree_dtypes(state.mu) == tree_dtypes(state.nu) == tree_dtypes(state.nu_max) == {
        torch.float32}
    for g in make_grads(params, steps=3):
        updates, state = opt.update(g, state, params)
        assert tree_dtypes(updates) == {torch.float32}
        params = fo.apply_updates(params, updates)
        assert tree_dtypes(params) == {torch.bfloat16}
        assert tree_dtypes(state.mu) == tree_dtypes(state.nu) == {torch.float32}
        assert tree_dtypes(state.nu_max) == {torch.float32}
    assert params["frozen"] is None


def test_bf16_moments_equal_float32_moments_of_the_upcast_grads():
    params = make_params(torch.bfloat16)
    grads = make_grads(params, steps=5)
    _, s16 = fmp_run(fo.adam(1e-2), params, grads)
    p32 = optree.tree_map(lambda p: p.float(), params)
    g32 = [optree.tree_map(lambda g: g.float(), g) for g in grads]
    _, s32 = fmp_run(fo.adam(1e-2), p32, g32)
    for a, b in zip(optree.tree_leaves(s16), optree.tree_leaves(s32), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "bf16"])
def test_state_dtype_bf16_stays_bf16(state_dtype):
    params = make_params(torch.float32)
    for opt, moments in [
        (fo.adam(1e-2, amsgrad=True, state_dtype=state_dtype), lambda s: (s.mu, s.nu, s.nu_max)),
        (fo.sgd(0.1, momentum=0.9, state_dtype=state_dtype), lambda s: (s.momentum,)),
        (fo.trace(0.9, state_dtype=state_dtype), lambda s: (s.trace,)),
    ]:
        state = opt.init(params)
        p = params
        for g in make_grads(params, steps=3):
            assert tree_dtypes(moments(state)) == {torch.bfloat16}
            updates, state = opt.update(g, state, p)
            assert tree_dtypes(updates) == {torch.float32}
            p = fo.apply_updates(p, updates)
            assert tree_dtypes(p) == {torch.float32}
        assert tree_dtypes(moments(state)) == {torch.bfloat16}
        assert state.count.dtype == torch.int32


def test_state_dtype_none_keeps_each_param_dtype():
    params = {"a": torch.randn(3, dtype=torch.bfloat16), "b": torch.randn(2),
              "c": torch.randn(2, dtype=torch.float16)}
    opt = fo.adamw(1e-2, state_dtype=None)
    state = opt.init(params)
    for g in make_grads(params, steps=2):
        updates, state = opt.update(g, state, params)
        params = fo.apply_updates(params, updates)
    assert {k: v.dtype for k, v in state.mu.items()} == {
        "a": torch.bfloat16, "b": torch.float32, "c": torch.float16}
    assert {k: v.dtype for k, v in params.items()} == {
        "a": torch.bfloat16, "b": torch.float32, "c": torch.float16}


def test_apply_updates_dtypes_and_float32_add():
    params = {"a": torch.tensor([256.0], dtype=torch.bfloat16), "b": torch.ones(2),
              "c": torch.ones(1, dtype=torch.float64), "n": None}
    updates = {"a": torch.tensor([1.5]), "b": torch.full((2,), 0.25),
               "c": torch.tensor([1e-12]), "n": None}
    out = fo.apply_updates(params, updates)
    assert out["n"] is None
    assert {k: v.dtype for k, v in out.items() if v is not None} == {
        "a": torch.bfloat16, "b": torch.float32, "c": torch.float64}
    # 256 + 1.5 = 257.5 in float32, rounded once to bf16 (spacing 2 at 256): 258
    assert out["a"].item() == 258.0
    assert torch.equal(out["b"], torch.full((2,), 1.25))
    assert out["c"].item() == 1.0 + 1e-12


# ------------------------------------------------------------------ purity


ALL_OPTS = [
    fo.sgd(0.1),
    fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    fo.sgd(0.1, momentum=0.9, dampening=0.2),
    fo.adam(1e-2, weight_decay=0.1, amsgrad=True),
    fo.adamw(exp_decay),
    fo.chain(fo.add_decayed_weights(0.1), fo.trace(0.9), fo.scale_by_learning_rate(0.1)),
    fo.chain(fo.scale_by_adam(), fo.scale(-1e-2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", ALL_OPTS, ids=range(len(ALL_OPTS)))
def test_update_and_apply_are_pure(opt, dtype):
    params = make_params(dtype)
    grads = make_grads(params, steps=3)
    state = opt.init(params)
    for g in grads:
        before = clone((params, g, state))
        updates, new_state = opt.update(g, state, params)
        new_params = fo.apply_updates(params, updates)
        for a, b in zip(optree.tree_leaves((params, g, state)), optree.tree_leaves(before),
                        strict=True):
            assert torch.equal(a, b) and a.dtype == b.dtype
        # nothing returned shares memory with an input
        inputs = {x.untyped_storage().data_ptr() for x in optree.tree_leaves((params, g, state))}
        outputs = optree.tree_leaves((updates, new_state, new_params))
        assert not any(x.untyped_storage().data_ptr() in inputs for x in outputs)
        params, state = new_params, new_state


# ------------------------------------------------------------------ chain and blocks


def test_chain_state_is_tuple_and_composes():
    a, b = fo.add_decayed_weights(0.1), fo.sgd(0.05, momentum=0.9)
    c = fo.chain(a, b)
    params = make_params()
    state = c.init(params)
    assert isinstance(state, tuple) and len(state) == 2
    assert isinstance(state[0], fo.EmptyState) and isinstance(state[1], fo.SgdState)
    sa, sb = a.init(params), b.init(params)
    for g in make_grads(params, steps=5):
        u, state = c.update(g, state, params)
        ua, sa = a.update(g, sa, params)
        ub, sb = b.update(ua, sb, params)
        for x, y in zip(optree.tree_leaves((u, state)), optree.tree_leaves((ub, (sa, sb))),
                        strict=True):
            assert torch.equal(x, y)
        params = fo.apply_updates(params, u)


@pytest.mark.parametrize("kwargs", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                                    dict(momentum=0.7, dampening=0.4)], ids=str)
def test_chain_of_blocks_is_sgd(kwargs):
    params = make_params()
    grads = make_grads(params)
    sgd = fo.sgd(0.05, weight_decay=0.01, **kwargs)
    trace_kwargs = {k: v for k, v in kwargs.items() if k != "momentum"}
    blocks = fo.chain(fo.add_decayed_weights(0.01), fo.trace(kwargs["momentum"], **trace_kwargs),
                      fo.scale_by_learning_rate(0.05))
    ours, _ = fmp_run(blocks, params, grads)
    ref, _ = fmp_run(sgd, params, grads)
    assert_history_close(ours, [optree.tree_leaves(r) for r in ref], atol=0, rtol=0)


def test_chain_of_blocks_is_adamw():
    params = make_params()
    grads = make_grads(params)
    blocks = fo.chain(fo.scale_by_adam(0.9, 0.99, 1e-8), fo.add_decayed_weights(0.1),
                      fo.scale_by_learning_rate(exp_decay))
    ours, state = fmp_run(blocks, params, grads)
    theirs, _, _ = torch_run(torch.optim.AdamW, dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.1),
                             params, grads, lr_lambda=lambda k: 0.9**k)
    assert_history_close(ours, theirs)
    assert [type(s) for s in state] == [fo.AdamState, fo.EmptyState, fo.ScaleByScheduleState]


def test_chain_rejects_non_transforms_and_bad_state():
    with pytest.raises(TypeError, match="argument 1"):
        fo.chain(fo.scale(1.0), lambda g: g)
    c = fo.chain(fo.scale(1.0), fo.scale(2.0))
    with pytest.raises(ValueError, match="tuple of 2 sub-states"):
        c.update({"w": torch.ones(1)}, (fo.EmptyState(),))


def test_trace_first_step_is_the_grad_then_momentum():
    t = fo.trace(0.9, dampening=0.5)
    s = t.init({"w": torch.zeros(1)})
    u, s = t.update({"w": torch.tensor([2.0])}, s)
    assert u["w"].item() == 2.0  # first step: buf = grad, no dampening
    u, s = t.update({"w": torch.tensor([2.0])}, s)
    assert u["w"].item() == pytest.approx(0.9 * 2.0 + 0.5 * 2.0)


# ------------------------------------------------------------------ trees and errors


def test_none_leaves_pass_through():
    params = {"w": torch.ones(2), "frozen": None, "sub": {"x": None}}
    for opt in ALL_OPTS:
        state = opt.init(params)
        u, state = opt.update({"w": torch.ones(2), "frozen": None, "sub": {"x": None}}, state,
                              params)
        assert u["frozen"] is None and u["sub"]["x"] is None
        out = fo.apply_updates(params, u)
        assert out["frozen"] is None and out["w"].shape == (2,)


@pytest.mark.parametrize(
    ("leaf", "what"),
    [(torch.arange(3), "torch.int64"), (torch.ones(2, dtype=torch.bool), "torch.bool"),
     (1.5, "float"), (torch.ones(2, dtype=torch.complex64), "torch.complex64")],
)
@pytest.mark.parametrize(
    "make",
    [lambda: fo.sgd(0.1), lambda: fo.sgd(0.1, momentum=0.9), fo.adam, fo.adamw, fo.scale_by_adam,
     lambda: fo.trace(0.9)],
    ids=["sgd", "sgd-momentum", "adam", "adamw", "scale_by_adam", "trace"],
)
def test_init_rejects_non_floating_leaves(make, leaf, what):
    params = {"layer": {"w": torch.ones(2), "n": [torch.ones(1), leaf]}}
    with pytest.raises(ValueError, match=re.escape("params['layer']['n'][1]") + ".*" + what):
        make().init(params)


def test_structure_mismatch_and_missing_params():
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    opt = fo.adamw(1e-2)
    state = opt.init(params)
    with pytest.raises(ValueError, match="structure"):
        opt.update({"a": torch.ones(2)}, state, {"a": torch.ones(2)})
    with pytest.raises(ValueError, match="needs params"):
        opt.update({"a": torch.ones(2), "b": torch.ones(3)}, state)
    with pytest.raises(ValueError, match="structure"):
        fo.apply_updates(params, {"a": torch.ones(2)})
    # without weight decay params are not needed
    u, _ = fo.adam(1e-2).update(params, fo.adam(1e-2).init(params))
    assert set(u) == {"a", "b"}


@pytest.mark.parametrize("opt", ALL_OPTS, ids=range(len(ALL_OPTS)))
def test_tree_without_leaves(opt):
    for params in ({}, {"a": None, "b": [None]}):
        state = opt.init(params)
        u, state = opt.update(params, state, params)
        assert u == params and fo.apply_updates(params, u) == params
        # without params the only state leaves are the int32 step counts, advanced once
        assert all(c.dtype == torch.int32 and int(c) == 1 for c in optree.tree_leaves(state))
    full = opt.init({"w": torch.ones(2)})
    if optree.tree_leaves(full)[1:]:  # holds moments: an empty grads tree is an error
        with pytest.raises(ValueError, match="structure"):
            opt.update({}, full, {})


def test_count_saturates_at_int32_max():
    opt = fo.sgd(0.1, momentum=0.9, dampening=0.1)
    params = {"w": torch.ones(2)}
    state = opt.init(params)._replace(count=torch.tensor(2**31 - 1, dtype=torch.int32))
    _, state = opt.update({"w": torch.ones(2)}, state)
    assert state.count.item() == 2**31 - 1 and state.count.dtype == torch.int32


BAD = [
    (fo.sgd, dict(lr=-0.1), "-0.1"),
    (fo.sgd, dict(lr=float("nan")), "nan"),
    (fo.sgd, dict(lr="0.1"), "'0.1'"),
    (fo.sgd, dict(lr=torch.tensor(0.1)), "tensor(0.1000)"),
    (fo.sgd, dict(lr=0.1, momentum=-0.5), "-0.5"),
    (fo.sgd, dict(lr=0.1, nesterov=True), "momentum=0.0"),
    (fo.sgd, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), "dampening=0.1"),
    (fo.sgd, dict(lr=0.1, weight_decay=-1e-4), "-0.0001"),
    (fo.sgd, dict(lr=0.1, state_dtype="int8"), "'int8'"),
    (fo.adam, dict(lr=-1.0), "-1.0"),
    (fo.adam, dict(betas=(1.0, 0.999)), "index 0 1.0"),
    (fo.adam, dict(betas=(0.9, -0.1)), "index 1 -0.1"),
    (fo.adam, dict(betas=(0.9,)), "(0.9,)"),
    (fo.adam, dict(eps=-1e-8), "-1e-08"),
    (fo.adam, dict(weight_decay=-0.1), "-0.1"),
    (fo.adamw, dict(lr=-1e-3), "-0.001"),
    (fo.adamw, dict(betas=(0.9, 1.5)), "1.5"),
    (fo.adamw, dict(eps=-1.0), "-1.0"),
    (fo.adamw, dict(weight_decay=-0.01), "-0.01"),
    (fo.scale_by_adam, dict(b1=1.0), "1.0"),
    (fo.add_decayed_weights, dict(weight_decay=-1.0), "-1.0"),
    (fo.trace, dict(decay=-0.9), "-0.9"),
    (fo.scale_by_learning_rate, dict(learning_rate=-1.0), "-1.0"),
    (fo.scale, dict(step_size="x"), "'x'"),
]


@pytest.mark.parametrize(("make", "kwargs", "shown"), BAD,
                         ids=[f"{m.__name__}-{k}" for m, k, _ in BAD])
def test_bad_hyper_parameters(make, kwargs, shown):
    with pytest.raises(ValueError, match=re.escape(shown) + ".*accepted|Nesterov") as info:
        make(**kwargs)
    assert shown in str(info.value)


# ------------------------------------------------------------------ compile


def _check_compiled(backend, opt, params):
    """One compiled update + apply_updates equals the eager one (from a non-trivial state)."""
    state = opt.init(params)
    g0, g1 = make_grads(params, steps=2)
    _, state = opt.update(g0, state, params)

    def step(params, state, g):
        updates, state = opt.update(g, state, params)
        return fo.apply_updates(params, updates), state

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(params, state, g1)
    want = step(params, state, g1)
    assert optree.tree_structure(got) == optree.tree_structure(want)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


# torch's own inductor import emits a torch.jit DeprecationWarning; not ours to fix
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    params = make_params()
    params["half"] = torch.randn(3, 2, dtype=torch.bfloat16)
    _check_compiled("aot_eager", fo.adamw(exp_decay, weight_decay=0.1, amsgrad=True), params)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compile_fullgraph_inductor():
    torch._dynamo.reset()
    params = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    _check_compiled("inductor", fo.adamw(exp_decay, weight_decay=0.1), params)


# ------------------------------------------------------------------ property test


shape_st = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=4),
    lr=st.floats(1e-4, 0.1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([0.0, 1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    amsgrad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adam_property_matches_torch(shapes, lr, b1, b2, eps, weight_decay, amsgrad, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    kwargs = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    theirs, _, _ = torch_run(torch.optim.Adam, {**kwargs, "foreach": False}, params, grads)
    ours, _ = fmp_run(fo.adam(**kwargs), params, grads)
    # eps = 0 with a zero-size-free grad is fine; the tolerance scales with lr
    assert_history_close(ours, theirs, atol=max(1e-6, 1e-5 * lr), rtol=1e-6)
    assert all(math.isfinite(x) for p in ours[-1] for x in p.flatten().tolist())
