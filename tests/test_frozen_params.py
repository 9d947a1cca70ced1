"""Frozen params (requires_grad=False): fmp.functional leaves them out of the trained params,
so a train step neither updates them nor allocates optimizer state for them."""

import pytest
import torch
import torch.nn.functional as F

import fmp
from tests.helpers import assert_trees_bit_equal, blobs, clone_tree


def _net(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                              torch.nn.GELU(), torch.nn.Linear(32, 2))
    net[0].requires_grad_(False)  # the "backbone" stays as it is
    net[4].bias.requires_grad_(False)
    return net


FROZEN = {"0.weight", "0.bias", "4.bias"}


def test_functional_splits_frozen_params():
    net = _net()
    apply_fn, params, _ = fmp.functional(net)
    assert set(params) == {"2.weight", "2.bias", "4.weight"}
    assert set(apply_fn.frozen) == FROZEN
    x = torch.randn(4, 8)
    torch.testing.assert_close(apply_fn(params, x), net(x), rtol=0, atol=0)
    # a name given in params wins over the frozen one
    full = {**apply_fn.frozen, **params, "0.bias": torch.zeros(32)}
    net[0].bias.data.zero_()
    torch.testing.assert_close(apply_fn(full, x), net(x), rtol=0, atol=0)


def test_frozen_params_stay_bit_identical_and_trainable_match_torch_optim():
    net = _net()
    ref = _net()
    frozen_before = {n: p.detach().clone() for n, p in net.named_parameters() if n in FROZEN}
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x), y)

    opt = fmp.optim.adamw(1e-2, weight_decay=0.1)
    step = fmp.train_step(loss_fn, opt, "fp32")
    state = fmp.TrainState.create(clone_tree(params), opt)
    assert set(state.opt_state.mu) == set(params) == set(state.opt_state.nu)
    torch_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.1)
    x, y = blobs(64)
    for i in range(20):
        xb, yb = x[i % 4 * 16:(i % 4 + 1) * 16], y[i % 4 * 16:(i % 4 + 1) * 16]
        state, _ = step(state, xb, yb)
        torch_opt.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        torch_opt.step()
        for n, p in ref.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(state.params[n], p.detach(), rtol=1e-5, atol=1e-6)
    assert set(state.params) == set(params)
    for n, before in frozen_before.items():
        assert torch.equal(dict(net.named_parameters())[n], before)
        assert torch.equal(apply_fn.frozen[n], before)
        assert torch.equal(dict(ref.named_parameters())[n], before)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("donate", [False, True])
def test_frozen_params_are_cast_like_the_trainable_ones(policy, donate):
    """The split gives bit-identical loss and grads to the unsplit model under mixed casts."""
    net = _net(1)
    apply_fn, params, _ = fmp.functional(net)
    whole = _net(1).requires_grad_(True)
    apply_all, params_all, _ = fmp.functional(whole)
    x, y = blobs(16)
    seen = []
    hook = net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    vg = fmp.value_and_grad(lambda p, a, b: F.cross_entropy(apply_fn(p, a).float(), b), policy)
    vg_all = fmp.value_and_grad(lambda p, a, b: F.cross_entropy(apply_all(p, a).float(), b),
                                policy)
    loss, grads, _ = vg(params, fmp.StaticLossScale(8.0), x, y)
    loss_all, grads_all, _ = vg_all(params_all, fmp.StaticLossScale(8.0), x, y)
    assert seen == [fmp.get_policy(policy).compute_dtype]
    assert torch.equal(loss, loss_all)
    assert_trees_bit_equal(grads, {n: grads_all[n] for n in params})
    hook.remove()
    opt = fmp.optim.adam(1e-2)
    step = fmp.train_step(lambda p, a, b: F.cross_entropy(apply_fn(p, a).float(), b), opt,
                          policy, donate=donate)
    state = fmp.TrainState.create(clone_tree(params), opt, fmp.DynamicLossScale.create())
    for _ in range(5):
        state, m = step(state, x, y)
    assert not bool(m["skipped"])
    assert set(state.params) == set(params) and set(state.opt_state.mu) == set(params)
    assert all(torch.equal(apply_fn.frozen[n], p) for n, p in _net(1).named_parameters()
               if n in FROZEN)


def test_hugging_face_gpt2_with_frozen_embeddings():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    for m in (model, ref):
        m.train()
        m.transformer.wte.requires_grad_(False)  # tied with lm_head: both frozen
        m.transformer.wpe.requires_grad_(False)
    frozen_names = {"transformer.wte.weight", "transformer.wpe.weight"}
    wte0 = model.transformer.wte.weight.detach().clone()
    apply_fn, params, _ = fmp.functional(model)
    assert frozen_names.isdisjoint(params) and frozen_names <= set(apply_fn.frozen)

    def loss_fn(p, ids):
        return apply_fn(p, input_ids=ids, labels=ids).loss.float()

    opt = fmp.optim.adamw(1e-3)
    step = fmp.train_step(loss_fn, opt, "fp32")
    state = fmp.TrainState.create(clone_tree(params), opt)
    assert frozen_names.isdisjoint(state.opt_state.mu)
    torch_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        state, m = step(state, ids)
        torch_opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        torch_opt.step()
    named = dict(ref.named_parameters())
    for n, v in state.params.items():
        torch.testing.assert_close(v, named[n].detach(), rtol=1e-4, atol=1e-5)
    assert torch.equal(model.transformer.wte.weight, wte0)
    assert torch.equal(model.lm_head.weight, wte0)
    # the bf16-mixed step runs too, frozen embeddings cast with the rest
    step16 = fmp.train_step(loss_fn, opt, "bf16-mixed")
    s16 = fmp.TrainState.create(clone_tree(params), opt)
    s16, m16 = step16(s16, ids)
    assert not bool(m16["skipped"]) and torch.equal(model.transformer.wte.weight, wte0)


@pytest.mark.slow
@pytest.mark.parametrize("whole_graph", [False, True])
def test_compiled_step_with_frozen_params_and_a_layer_norm_matches_eager(whole_graph):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                              torch.nn.Linear(16, 2))
    net[0].requires_grad_(False)
    apply_fn, params, _ = fmp.functional(net)
    seen = []

    def loss_fn(p, x, y):
        seen.append(p["1.weight"].dtype)
        return F.cross_entropy(apply_fn(p, x).float(), y)

    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(loss_fn, opt, "bf16-mixed")
    cstep = fmp.compile(step, backend="aot_eager", whole_graph=whole_graph)
    s_e = fmp.TrainState.create(clone_tree(params), opt)
    s_c = fmp.TrainState.create(clone_tree(params), opt)
    x, y = blobs(16)
    for _ in range(3):
        s_e, _ = step(s_e, x, y)
        s_c, _ = cstep(s_c, x, y)
    assert set(seen) == {torch.float32}  # the LayerNorm kept in float32, compiled too
    torch.testing.assert_close(s_c.params, s_e.params, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(apply_fn.frozen[n], p) for n, p in net.named_parameters()
               if not p.requires_grad)
