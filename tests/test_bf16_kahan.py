"""bf16 params with no float32 copy: Kahan-compensated and stochastically rounded writes."""

from __future__ import annotations

import io

import optree
import pytest
import torch

import fmp
from fmp.demo.cli import _policies
from fmp.optim._bits import leaf_seed, random16, round_bf16, stochastic_round_bf16

BF16 = torch.bfloat16


def _bits_equal(a, b) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                            for x, y in zip(la, lb, strict=True))


# --- Kahan: the arithmetic, exactly -------------------------------------------------------

def test_kahan_three_updates_match_a_float64_hand_computation():
    g = torch.Generator().manual_seed(0)
    p = {"w": (1 + torch.rand(4096, generator=g)).to(BF16)}
    us = [torch.randn(4096, generator=g) * 3e-3 for _ in range(3)]
    t = fmp.optim.kahan_summation()
    s = t.init(p)
    p64, c64 = p["w"].double(), torch.zeros(4096, dtype=torch.float64)
    for u in us:
        delta, s = t.update({"w": u}, s, p)
        p = fmp.optim.apply_updates(p, delta)
        # the algorithm's float32 sums, each rounded to float32 once
        target = (p64 + (u.double() + c64).float().double()).float().double()
        written = target.to(BF16).double()       # rounded once
        c64 = (target - written).to(BF16).double()
        p64 = written
        assert p["w"].dtype == BF16 and torch.equal(p["w"].double(), p64)
        assert s.compensation["w"].dtype == BF16
        assert torch.equal(s.compensation["w"].double(), c64)
    assert c64.abs().max() > 0  # the compensation holds something


def test_adamw_kahan_one_step_against_float64_and_the_moments_of_plain_adamw():
    g = torch.Generator().manual_seed(1)
    p = {"a": torch.randn(64, 32, generator=g).to(BF16), "b": torch.randn(32, generator=g).to(BF16)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in p.items()}
    plain = fmp.optim.adamw(1e-3, weight_decay=0.1, state_dtype="bf16")
    kahan = fmp.optim.adamw(1e-3, weight_decay=0.1, state_dtype="bf16", bf16_update="kahan")
    u, s_plain = plain.update(grads, plain.init(p), p)
    delta, (s_adam, s_kahan) = kahan.update(grads, kahan.init(p), p)
    assert _bits_equal(s_adam, s_plain)  # the composition leaves Adam's own state alone
    new = fmp.optim.apply_updates(p, delta)
    for k in p:
        target = (p[k].double() + u[k].double()).float().double()  # in float32
        assert torch.equal(new[k], target.to(BF16)), k
        assert torch.equal(s_kahan.compensation[k], (target - new[k].double()).to(BF16)), k


def test_apply_updates_writes_the_value_kahan_computed_even_for_a_2_20_fold_shrink():
    p = {"w": torch.tensor([2.0**20, 1e-3, 3.0, -7.5], dtype=BF16)}
    u = torch.tensor([-(2.0**20) + 1.5 * 2.0**-20, -1e-3 + 1e-9, 1e-4, 2e-4])
    t = fmp.optim.kahan_summation()
    delta, s = t.update({"w": u}, t.init(p), p)
    new = fmp.optim.apply_updates(p, delta)["w"]
    target = p["w"].float() + u
    # what was written plus what the buffer holds is the exact target, to bf16 precision of c
    assert torch.equal(s.compensation["w"], (target - new.float()).to(BF16))
    assert torch.equal(new[2:], target[2:].to(BF16))  # ordinary steps: the rounded target


def test_kahan_keeps_a_tiny_update_that_plain_bf16_loses():
    grads = {"w": -torch.ones(8)}
    results = {}
    for mode in (None, "kahan", "stochastic"):
        opt = fmp.optim.sgd(1e-3, bf16_update=mode)
        p = {"w": torch.ones(8, dtype=BF16)}
        s = opt.init(p)
        for _ in range(100):
            u, s = opt.update(grads, s, p)
            p = fmp.optim.apply_updates(p, u)
        results[mode] = p["w"].double()
    assert torch.equal(results[None], torch.ones(8, dtype=torch.float64))  # 1e-3 < ulp/2
    assert (results["kahan"] - 1.1).abs().max() <= 2.0**-7  # within one bf16 spacing
    assert (results["stochastic"].mean() - 1.1).abs() < 0.02


def test_kahan_passes_float32_leaves_through_and_keeps_no_buffer_for_them():
    p = {"w": torch.ones(3, dtype=BF16), "n": torch.ones(3)}
    opt = fmp.optim.adam(1e-2, bf16_update="kahan")
    s = opt.init(p)
    assert s[1].compensation["n"].numel() == 0
    u, _ = opt.update({"w": torch.ones(3), "n": torch.ones(3)}, s, p)
    u_plain, _ = fmp.optim.adam(1e-2).update({"w": torch.ones(3), "n": torch.ones(3)},
                                             fmp.optim.adam(1e-2).init(p), p)
    assert torch.equal(u["n"], u_plain["n"])


# --- stochastic rounding -----------------------------------------------------------------

def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    lo = torch.tensor(1.0, dtype=BF16).float()
    hi = lo + 2.0**-7
    x = torch.full((200_000,), float(lo + 0.3 * 2.0**-7))
    r = stochastic_round_bf16(x, random16(leaf_seed(torch.tensor(7), 0), x.shape))
    assert r.dtype == BF16
    assert set(r.float().unique().tolist()) == {float(lo), float(hi)}
    frac = (r.float() == hi).double().mean().item()
    assert abs(frac - 0.3) < 4 * (0.3 * 0.7 / x.numel()) ** 0.5  # 4 sigma
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    out = stochastic_round_bf16(exact, torch.full((5,), 65535, dtype=torch.int32))
    assert torch.equal(out.float(), exact)  # representable values never move
    assert torch.isnan(stochastic_round_bf16(torch.tensor([float("nan")]),
                                             torch.tensor([65535], dtype=torch.int32))).all()


def test_stochastic_rounding_is_deterministic_for_a_state_and_moves_its_key():
    g = torch.Generator().manual_seed(2)
    p = {"a": torch.randn(500, generator=g).to(BF16), "b": torch.randn(500, generator=g).to(BF16)}
    grads = {k: torch.randn(500, generator=g) for k in p}
    opt = fmp.optim.adam(1e-3, bf16_update="stochastic")
    s = opt.init(p)
    u1, s1 = opt.update(grads, s, p)
    u2, s2 = opt.update(grads, s, p)
    assert _bits_equal(u1, u2) and _bits_equal(s1, s2)
    assert int(s1[1].key) == int(s[1].key) + 1
    u3, _ = opt.update(grads, s1, p)  # the next key rounds otherwise
    assert not torch.equal(u3["a"], u1["a"])
    other = fmp.optim.chain(fmp.optim.adam(1e-3), fmp.optim.stochastic_rounding(seed=5))
    u4, _ = other.update(grads, other.init(p), p)
    assert not torch.equal(u4["a"], u1["a"])
    assert not torch.equal(random16(leaf_seed(s[1].key, 0), (500,)),
                           random16(leaf_seed(s[1].key, 1), (500,)))  # leaves differ


# --- the train step ----------------------------------------------------------------------

def _problem():
    g = torch.Generator().manual_seed(3)
    params = {"w": (torch.randn(16, 4, generator=g) * 0.3).to(BF16),
              "b": torch.zeros(4, dtype=BF16)}
    x = torch.randn(32, 16, generator=g)
    y = torch.randn(32, 4, generator=g)

    def loss_fn(p, x, y):
        return torch.nn.functional.mse_loss((x @ p["w"] + p["b"]).float(), y.float())

    return params, x, y, loss_fn


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_train_step_eager_equals_the_manual_loop(mode):
    params, x, y, loss_fn = _problem()
    opt = fmp.optim.adamw(1e-3, state_dtype="bf16", bf16_update=mode)
    step = fmp.train_step(loss_fn, opt, "bf16-true")
    state = fmp.TrainState.create(params, opt)
    p, s = params, opt.init(params)
    for _ in range(5):
        state, m = step(state, x, y)
        grads = torch.func.grad(loss_fn)(p, x.to(BF16), y.to(BF16))
        u, s = opt.update(grads, s, p)
        p = fmp.optim.apply_updates(p, u)
        assert not bool(m["skipped"])
    assert _bits_equal(state.params, p) and _bits_equal(state.opt_state, s)
    assert all(v.dtype == BF16 for v in state.params.values())


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_skipped_step_leaves_params_moments_buffers_and_key_bit_identical(mode, donate):
    params, x, y, loss_fn = _problem()
    opt = fmp.optim.adamw(1e-3, state_dtype="bf16", bf16_update=mode)
    step = fmp.train_step(loss_fn, opt, "bf16-true", donate=donate)
    state = fmp.TrainState.create(params, opt)
    for _ in range(3):
        state, _ = step(state, x, y)
    before = fmp.TrainState.from_state_dict(
        torch.load(_saved(state), weights_only=True))  # a private copy
    bad = x.clone()
    bad[0, 0] = float("inf")
    state, m = step(state, bad, y)
    assert bool(m["skipped"])
    assert _bits_equal(state.params, before.params)
    assert _bits_equal(state.opt_state, before.opt_state)  # moments, compensation, key
    state, m = step(state, x, y)  # and training goes on
    assert not bool(m["skipped"]) and not _bits_equal(state.params, before.params)


def test_the_in_place_fast_path_is_not_taken_for_these_options():
    p = {"w": torch.ones(4, dtype=BF16)}
    g = {"w": torch.ones(4, dtype=BF16)}
    plain = fmp.optim.adamw(state_dtype="bf16")
    assert fmp.optim.in_place_supported(plain, p, g, plain.init(p))  # the check can say yes
    for mode in ("kahan", "stochastic"):
        for opt in (fmp.optim.adamw(state_dtype="bf16", bf16_update=mode),
                    fmp.optim.adam(state_dtype="bf16", bf16_update=mode),
                    fmp.optim.sgd(0.1, momentum=0.9, state_dtype="bf16", bf16_update=mode)):
            assert not fmp.optim.in_place_supported(opt, p, g, opt.init(p))


def _saved(state) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_checkpoint_round_trip_resumes_bit_identically(mode):
    params, x, y, loss_fn = _problem()
    opt = fmp.optim.sgd(1e-2, momentum=0.9, state_dtype="bf16", bf16_update=mode)
    step = fmp.train_step(loss_fn, opt, "bf16-true")
    state = fmp.TrainState.create(params, opt)
    for _ in range(3):
        state, _ = step(state, x, y)
    resumed = fmp.TrainState.from_state_dict(torch.load(_saved(state), weights_only=True))
    assert _bits_equal(resumed.opt_state, state.opt_state)
    for _ in range(3):
        state, _ = step(state, x, y)
        resumed, _ = step(resumed, x, y)
    assert _bits_equal(resumed.params, state.params)
    assert _bits_equal(resumed.opt_state, state.opt_state)


# --- memory, errors, the demo's names ----------------------------------------------------

def test_state_bytes_per_param():
    p16 = {"w": torch.zeros(10_000, dtype=BF16)}
    p32 = {"w": torch.zeros(10_000)}

    def bpp(params, opt):
        return round(fmp.optim.state_bytes_per_param(params, opt.init(params)), 2)

    assert bpp(p16, fmp.optim.adamw(state_dtype="bf16", bf16_update="kahan")) == 8.0
    assert bpp(p16, fmp.optim.adamw(state_dtype="f32", bf16_update="kahan")) == 12.0
    assert bpp(p16, fmp.optim.adamw(state_dtype="bf16", bf16_update="stochastic")) == 6.0
    assert bpp(p16, fmp.optim.adamw(state_dtype="f32", bf16_update="stochastic")) == 10.0
    assert bpp(p32, fmp.optim.adamw()) == 12.0  # float32 masters, float32 moments
    assert fmp.optim.state_bytes_per_param({}) == 0.0


def test_bad_options_raise_naming_the_value():
    for fn in (fmp.optim.adam, fmp.optim.adamw, lambda **k: fmp.optim.sgd(0.1, **k)):
        for bad in ("Kahan", "sr", 1, True):
            with pytest.raises(ValueError, match=f"invalid bf16_update {bad!r}.*'kahan'"):
                fn(bf16_update=bad)
    for bad in (-1, 2**31, True, 1.5):
        with pytest.raises(ValueError, match=f"invalid seed {bad!r}"):
            fmp.optim.stochastic_rounding(seed=bad)
    with pytest.raises(ValueError, match="param 'w' is float16"):
        fmp.optim.adam(bf16_update="stochastic").init({"w": torch.ones(2, dtype=torch.float16)})
    p = {"w": torch.ones(2, dtype=BF16)}
    t = fmp.optim.kahan_summation()
    with pytest.raises(ValueError, match="needs params"):
        t.update({"w": torch.ones(2)}, t.init(p))
    with pytest.raises(TypeError, match="KahanState"):
        t.update({"w": torch.ones(2)}, fmp.optim.EmptyState(), p)
    with pytest.raises(ValueError, match=r"compensation of leaf .w. is torch.bfloat16 \(3,\)"):
        t.update({"w": torch.ones(2)}, t.init({"w": torch.ones(3, dtype=BF16)}), p)


def test_demo_names_the_bf16_rows_and_rejects_an_unknown_write():
    assert _policies("bf16-mixed,bf16-true,bf16-true+kahan,bf16-true+stochastic")[2] == \
        "bf16-true+kahan"
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown bf16 update 'fast'"):
        _policies("bf16-true+fast")


def test_hf_gpt2_pure_bf16_with_compensation_trains_like_bf16_mixed_and_plain_bf16_stalls():
    """A model nobody here wrote (transformers' GPT-2, tiny config) at a small learning rate:
    Adam's steps fall below half a bf16 spacing of most weights, so plain bf16 loses them."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    drop = {}
    for policy, mode in [("bf16-mixed", None), ("bf16-true", None), ("bf16-true", "kahan"),
                         ("bf16-true", "stochastic")]:
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=True)
        apply_fn, params, _ = fmp.functional(transformers.GPT2LMHeadModel(cfg).train())
        params = fmp.get_policy(policy).cast_to_param(params)
        opt = fmp.optim.adamw(3e-5, weight_decay=0.0, state_dtype="bf16" if mode else "f32",
                              bf16_update=mode)
        step = fmp.train_step(lambda p, x, f=apply_fn: f(p, input_ids=x, labels=x).loss, opt,
                              policy)
        state = fmp.TrainState.create(params, opt)
        losses = []
        for _ in range(20):
            state, m = step(state, ids)
            losses.append(float(m["loss"]))
        drop[policy, mode] = losses[0] - losses[-1]
    ref = drop["bf16-mixed", None]
    assert ref > 0
    assert abs(drop["bf16-true", "kahan"] - ref) < 0.1 * ref
    assert abs(drop["bf16-true", "stochastic"] - ref) < 0.15 * ref
    assert drop["bf16-true", None] < 0.4 * ref  # the counter-example: plain bf16 stalls


def test_round_bf16_with_integer_ops_is_torchs_cast_and_float16_is_refused():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-140, 120, (100_000,),
                                                                     generator=g).float())
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 1e-45])])
    assert torch.equal(round_bf16(x), x.to(BF16).float())
    assert torch.isnan(round_bf16(torch.tensor([float("nan")]))).all()
    with pytest.raises(ValueError, match=r"param 'h' is float16.*fp16-mixed"):
        fmp.optim.adamw(bf16_update="kahan").init({"h": torch.ones(2, dtype=torch.float16)})


@pytest.mark.slow
def test_compiled_kahan_rounds_as_eager():
    """inductor may drop a bf16 cast pair inside a fused kernel (emulate_precision_casts off):
    the roundings are integer ops, so the compiled update keeps its compensation."""
    g = torch.Generator().manual_seed(5)
    p = {"w": torch.randn(256, generator=g).to(BF16)}
    u = {"w": torch.randn(256, generator=g) * 1e-3}
    t = fmp.optim.kahan_summation()
    s = t.init(p)
    assert _bits_equal(torch.compile(t.update, fullgraph=True)(u, s, p), t.update(u, s, p))
