"""Issue 16 item 6: float64 policies, zero-element params, complex leaves.

float64 trains (eager and compiled) and matches torch.optim in float64; a param with no
elements trains beside the others; a complex leaf is a clear error, never left out of
the finite check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, clone_tree

import fmp
from fmp import optim

F64 = fmp.Policy(torch.float64, torch.float64, torch.float64)


def test_all_finite_on_float64_leaves():
    big = torch.tensor([1e300], dtype=torch.float64)  # finite, beyond float32's range
    assert bool(fmp.all_finite({"a": big}))
    assert bool(fmp.all_finite({"a": big, "b": torch.ones(2)}))
    for bad in (float("inf"), float("nan")):
        t = torch.tensor([1.0, bad], dtype=torch.float64)
        assert not bool(fmp.all_finite({"a": t, "b": torch.ones(2)}))
        assert not bool(fmp.all_finite([torch.ones(2), t]))
    assert not bool(fmp.all_finite({"a": big, "b": torch.tensor([float("inf")])}))


def test_all_finite_with_empty_leaves():
    e = torch.ones(0, 3)
    assert bool(fmp.all_finite({"e": e}))
    assert bool(fmp.all_finite({"e": e, "w": torch.ones(2)}))
    assert not bool(fmp.all_finite({"e": e, "w": torch.tensor([float("nan")])}))
    assert not bool(fmp.all_finite([torch.ones(0, dtype=torch.float64),
                                    torch.tensor([float("inf")], dtype=torch.float64)]))


class Net(torch.nn.Module):
    """A linear model with a zero-element parameter (e.g. a 0-width adapter) in its loss."""

    def __init__(self, dtype=torch.float32, empty=True):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3, dtype=dtype)
        if empty:
            self.adapter = torch.nn.Parameter(torch.zeros(0, 4, dtype=dtype))

    def forward(self, x):
        out = self.lin(x)
        if hasattr(self, "adapter"):
            out = out + (x @ self.adapter.t()).sum()  # the empty param is used: grad (0, 4)
        return out


def _data(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=dtype), torch.randint(0, 3, (8,), generator=g)


def _torch_trajectory(make_opt, dtype, steps, empty):
    net = Net(dtype, empty)
    opt = make_opt(net.parameters())
    x, y = _data(dtype)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


OPTS = [
    ("sgd", lambda: optim.sgd(0.1, momentum=0.9, weight_decay=1e-2, state_dtype=None),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2)),
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1, state_dtype=None),
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize(("name", "fmp_opt", "torch_opt"), OPTS, ids=[o[0] for o in OPTS])
@pytest.mark.parametrize(("policy", "dtype", "empty"), [
    (F64, torch.float64, False), (F64, torch.float64, True), ("fp32", torch.float32, True),
], ids=["f64", "f64-empty", "f32-empty"])
def test_train_step_matches_torch_optim(policy, dtype, empty, name, fmp_opt, torch_opt, donate):
    net = Net(dtype, empty)
    apply_fn, params, _ = fmp.functional(net)
    params = clone_tree(params)
    opt = fmp_opt()
    ls = fmp.DynamicLossScale.create(initial=2.0**8)
    state = fmp.TrainState.create(params, opt, ls)
    step = fmp.train_step(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y), opt, policy,
                          donate=donate)
    x, y = _data(dtype)
    want = _torch_trajectory(torch_opt, dtype, 3, empty)
    for w in want:
        state, m = step(state, x, y)
        assert not bool(m["skipped"])
        for k in w:
            assert state.params[k].dtype == dtype and state.params[k].shape == w[k].shape
            torch.testing.assert_close(state.params[k], w[k], rtol=1e-12 if dtype ==
                                       torch.float64 else 1e-5, atol=1e-12 if dtype ==
                                       torch.float64 else 1e-6)


@pytest.mark.parametrize("policy", [F64, "fp16-mixed", "bf16-mixed"])
def test_skips_with_float64_or_empty_params_leave_everything_as_it_was(policy):
    dtype = torch.float64 if policy is F64 else torch.float32
    net = Net(dtype, empty=True)
    apply_fn, params, _ = fmp.functional(net)
    factor = {"f": torch.tensor(1.0)}

    def loss_fn(p, x, y):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, x), factor["f"]).float(), y)

    opt = optim.adam(1e-2)
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**8))
    step = fmp.train_step(loss_fn, opt, policy, accumulate=2)
    x, y = _data(dtype)
    state, m = step(state, x, y)
    assert not bool(m["skipped"])
    before = clone_tree((state.params, state.opt_state))
    factor["f"] = torch.tensor(float("inf"))
    state, m = step(state, x, y)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**7
    assert_trees_bit_equal((state.params, state.opt_state), before)


def test_value_and_grad_float64_and_empty_grads_are_exact():
    p = {"w": torch.tensor([1.5, -2.0], dtype=torch.float64), "e": torch.ones(0, 2,
                                                                           dtype=torch.float64)}

    def loss_fn(p, x):
        return (p["w"] * x).sum() ** 2 + p["e"].sum()

    x = torch.tensor([3.0, 1.0], dtype=torch.float64)
    _, g, finite = fmp.value_and_grad(loss_fn, F64)(
        p, fmp.StaticLossScale(2.0**10), x)
    assert bool(finite) and g["e"].shape == (0, 2) and g["w"].dtype == torch.float64
    assert torch.equal(g["w"], 2 * (1.5 * 3 - 2.0) * x)


def test_complex_leaves_are_a_clear_error():
    net = torch.nn.Linear(2, 2)
    net.register_parameter("c", torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)))
    _, params, _ = fmp.functional(net)
    with pytest.raises(ValueError, match=r"params\['c'\] is a torch.complex64"):
        fmp.TrainState.create(params, optim.adamw())
    with pytest.raises(TypeError, match=r"'c' is a torch.complex64.*complex"):
        fmp.all_finite({"w": torch.ones(2), "c": torch.tensor([complex(float("nan"), 0)])})

    def loss_fn(p, x):
        return (p["c"] * x).abs().sum() + p["weight"].sum()

    with pytest.raises(TypeError, match="complex"):
        fmp.value_and_grad(loss_fn)(params, fmp.NoOpLossScale(), torch.ones(2))


@pytest.mark.slow
def test_compiled_step_with_float64_and_an_empty_param():
    net = Net(torch.float64, empty=True)
    apply_fn, params, _ = fmp.functional(net)
    opt = optim.adamw(1e-2, weight_decay=0.1, state_dtype=None)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x), y)

    step = fmp.train_step(loss_fn, opt, F64)
    x, y = _data(torch.float64)
    eager = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create())
    comp = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create())
    cstep = fmp.compile(step)
    for _ in range(2):
        eager, _ = step(eager, x, y)
        comp, mc = cstep(comp, x, y)
        assert not bool(mc["skipped"])
        for k in eager.params:
            torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize(("policy", "dtype"), [(F64, torch.float64), ("bf16-mixed",
                                                                      torch.float32)])
def test_cuda_float64_and_empty_params_train_without_a_host_sync(policy, dtype, donate):
    net = Net(dtype, empty=True).cuda()
    apply_fn, params, _ = fmp.functional(net)
    # a scheduled rate too: its check (schedule_ok) must not sync either
    opt = optim.adamw(lambda c: 1e-2 / (1.0 + c.to(torch.float32)), weight_decay=0.1)
    state = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create())
    step = fmp.train_step(lambda p, x, y: F.cross_entropy(apply_fn(p, x).float(), y), opt,
                          policy, donate=donate)
    x, y = (t.cuda() for t in _data(dtype))
    state, _ = step(state, x, y)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            state, m = step(state, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(m["skipped"]) and bool(m["lr_ok"])
    assert state.params["adapter"].shape == (0, 4)
    assert all(bool(torch.isfinite(v).all()) for v in state.params.values())
