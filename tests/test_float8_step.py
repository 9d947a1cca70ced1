"""fmp.train_step with float8 records (CPU; CUDA marked): delayed scaling updates the records
exactly as the hand formula from the step's amaxes, micro-batches combine amaxes by max, a
skipped step leaves everything bit-identical, checkpoints round-trip exactly, a layer run
twice is refused, a Hugging Face model trains; compiled (slow) and CUDA-graphed (cuda)."""

from __future__ import annotations

import io

import pytest
import torch

import fmp
from fmp.float8 import Recipe

E4M3, E5M2 = 448.0, 57344.0


def _net(recipe, seed=0, device="cpu"):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)).to(device)
    return fmp.float8.convert(net, recipe)


def _setup(recipe, loss_scale=None, accumulate=1, device="cpu", donate=False):
    net = _net(recipe, device=device)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(params, opt, loss_scale, float8=fmp.float8.init(net))

    def loss_fn(p, x, t):  # d loss / d out = t: the grad output's amax is known
        return (apply_fn(p, x).float() * t).sum()

    step = fmp.train_step(loss_fn, opt, "bf16-mixed", accumulate=accumulate, donate=donate)
    return state, step


def _f32(v):
    return float(torch.tensor(v, dtype=torch.float32))


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_delayed_step_updates_the_records_as_the_hand_formula():
    state, step = _setup(Recipe("delayed", history=2, margin=1), fmp.StaticLossScale(8.0))
    hist = [[0.0, 0.0] for _ in range(3)]
    scale = [1.0, 1.0, 1.0]
    for i in range(3):
        x = torch.randn(8, 32) * (i + 1)
        t = torch.randn(8, 16).to(torch.bfloat16).float()
        w = state.params["0.weight"]
        amaxes = [float(x.to(torch.bfloat16).abs().max()),
                  float(w.to(torch.bfloat16).abs().max()),
                  8.0 * float(t.abs().max())]  # the grad output scaled by the loss scale
        state, m = step(state, x, t)
        assert bool(m["grads_finite"])
        hist = [[a, row[0]] for a, row in zip(amaxes, hist, strict=True)]
        scale = [_f32(top / max(row)) / 2 for top, row in zip((E4M3, E4M3, E5M2), hist,
                                                               strict=True)]
        r = state.float8["0"]
        assert r.amax_history.tolist() == hist
        assert r.scale.tolist() == scale


def test_the_delayed_scales_are_the_ones_the_casts_use():
    # a fresh record's scale 1 saturates an input of 1000 at 448; after one step the
    # history scales it into range, and the next forward matches float32 closely
    state, step = _setup(Recipe("delayed", history=1))
    x, t = torch.randn(8, 32) * 1000, torch.randn(8, 16)
    state, _ = step(state, x, t)
    assert state.float8["0"].scale[0] == _f32(E4M3 / float(x.to(torch.bfloat16).abs().max()))


def test_micro_batches_combine_amaxes_by_max():
    state, step = _setup(Recipe("delayed", history=1), accumulate=2)
    x = torch.randn(8, 32)
    x[5, 3] = 40.0  # in the second micro-batch
    t = torch.randn(8, 16).to(torch.bfloat16).float()
    t[1, 0] = 9.0  # in the first
    state, _ = step(state, x, t)
    h = state.float8["0"].amax_history[:, 0].tolist()
    assert h[0] == 40.0 and h[2] == 9.0


def test_dynamic_records_stay_and_params_train():
    state, step = _setup("dynamic")
    before = state.float8["0"]
    state2, _ = step(state, torch.randn(8, 32), torch.randn(8, 16))
    assert state2.float8["0"] is before
    assert not torch.equal(state2.params["0.weight"], state.params["0.weight"])


@pytest.mark.parametrize("donate", [False, True])
def test_a_skipped_step_leaves_everything_bit_identical(donate):
    state, step = _setup(Recipe("delayed", history=3), fmp.DynamicLossScale(2.0 ** 4),
                         donate=donate)
    state, _ = step(state, torch.randn(8, 32), torch.randn(8, 16))
    snap = [x.clone() for x in (state.params["0.weight"], state.float8["0"].amax_history,
                                state.float8["0"].scale)]
    x = torch.randn(8, 32)
    x[0, 0] = float("inf")
    new, m = step(state, x, torch.randn(8, 16))
    assert bool(m["skipped"])
    got = [new.params["0.weight"], new.float8["0"].amax_history, new.float8["0"].scale]
    for a, b in zip(got, snap, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_checkpoint_round_trip_is_exact_and_resumes_identically():
    state, step = _setup(Recipe("delayed", history=2, margin=1))
    batches = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(3)]
    state, _ = step(state, *batches[0])
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    back = fmp.TrainState.from_state_dict(torch.load(buf))
    r, b = state.float8["0"], back.float8["0"]
    assert torch.equal(_bits(r.amax_history), _bits(b.amax_history))
    assert torch.equal(_bits(r.scale), _bits(b.scale)) and b.margin == 1
    buf2 = io.BytesIO()
    torch.save(state, buf2)  # the whole state: fmp's safe globals include the record
    buf2.seek(0)
    pickled = torch.load(buf2)
    for s in (back, pickled):
        a, c = state, s
        for bt in batches[1:]:
            a, _ = step(a, *bt)
            c, _ = step(c, *bt)
        assert torch.equal(a.params["0.weight"], c.params["0.weight"])
        assert torch.equal(a.float8["0"].scale, c.float8["0"].scale)


def test_state_without_float8_saves_as_before():
    state = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1))
    assert "float8" not in state.state_dict() and state.float8 is None
    assert fmp.TrainState.from_state_dict(state.state_dict()).float8 is None


def test_create_checks_the_records():
    with pytest.raises(TypeError, match="the entry '0' is int"):
        fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1), float8={"0": 3})


def test_a_delayed_layer_run_twice_names_the_layer():
    net = _net("delayed")
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)
    state = fmp.TrainState.create(params, opt, float8=fmp.float8.init(net))
    step = fmp.train_step(lambda p, x: apply_fn(p, apply_fn(p, x)[:, :0].sum() + x).sum(),
                          opt)
    with pytest.raises(ValueError, match="Float8Linear '0' ran twice in one loss call"):
        step(state, torch.randn(4, 32))


def test_a_layer_without_a_record_is_named():
    net = _net("delayed")
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)
    other = fmp.float8.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), "delayed")
    state = fmp.TrainState.create(params, opt, float8={"x": fmp.float8.init(other)["0"]})
    step = fmp.train_step(lambda p, x: apply_fn(p, x).sum(), opt)
    with pytest.raises(ValueError, match=r"the Float8Linear '0' has no record in state.float8"):
        step(state, torch.randn(4, 32))


class _Single:  # a one-process GradReducer: what a data-parallel step is built with
    def reduce(self, grads):
        return grads

    def all_finite(self, tree):
        return fmp.all_finite(tree)


def test_data_parallel_refuses_delayed_and_agrees_on_saturated_infs():
    from fmp.step import build_train_step

    for recipe, donate in (("delayed", False), ("dynamic", False), ("dynamic", True)):
        net = _net(recipe)
        apply_fn, params, _ = fmp.functional(net)
        opt = fmp.optim.sgd(0.1)
        state = fmp.TrainState.create(params, opt, float8=fmp.float8.init(net))
        step = build_train_step(lambda p, x, _f=apply_fn: _f(p, x).float().sum(), opt,
                                "bf16-mixed",
                                donate=donate, reducer=_Single())
        x = torch.randn(4, 32)
        x[0, 0] = float("inf")  # saturated by the cast: only the amax shows it
        if recipe == "delayed":
            with pytest.raises(ValueError, match="'0' uses delayed scaling, which a "
                                                 "data-parallel step does not support"):
                step(state, x)
            continue
        w = state.params["0.weight"].clone()
        new, m = step(state, x)
        assert bool(m["skipped"]) and torch.equal(new.params["0.weight"], w)


def _tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).train()


def test_hugging_face_llama_converted_trains():
    model = fmp.float8.convert(_tiny_llama(), Recipe("delayed", history=4))
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert n == 8  # q, k, v, o, gate, up, down, lm_head
    apply_fn, params, _ = fmp.functional(model)
    opt = fmp.optim.adam(1e-2)
    state = fmp.TrainState.create(params, opt, float8=fmp.float8.init(model))

    def loss_fn(p, ids):
        return apply_fn(p, input_ids=ids, labels=ids).loss

    step = fmp.train_step(loss_fn, opt, "bf16-mixed")
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(8):
        state, m = step(state, ids)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    scale = state.float8["model.layers.0.self_attn.q_proj"].scale
    assert (scale != 1.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("whole_graph", [False, True])
def test_compiled_step_matches_eager(whole_graph):
    state, step = _setup(Recipe("delayed", history=2))
    cstep = fmp.compile(step, backend="aot_eager", whole_graph=whole_graph)
    batches = [(torch.randn(8, 32), torch.randn(8, 16)) for _ in range(3)]
    a, c = state, state
    for bt in batches:
        a, _ = step(a, *bt)
        c, _ = cstep(c, *bt)
    assert torch.equal(a.params["0.weight"], c.params["0.weight"])
    assert torch.equal(a.float8["0"].amax_history, c.float8["0"].amax_history)
    assert torch.equal(a.float8["0"].scale, c.float8["0"].scale)


@pytest.mark.cuda
@pytest.mark.parametrize("whole_graph", [False, True])
def test_cuda_graphed_compiled_step_matches_the_compiled_step(whole_graph):
    state, step = _setup(Recipe("delayed", history=4), fmp.DynamicLossScale(2.0 ** 8),
                         device="cuda", donate=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [(torch.randn(32, 32, device="cuda", generator=g),
                torch.randn(32, 16, device="cuda", generator=g)) for _ in range(4)]
    # the graph replays the compiled step's kernels: the same results as running it
    # without a graph, bit for bit (inductor's fusions round differently from eager, and
    # a float8 rounding boundary turns that into a float8 ulp, so eager is not the reference)
    ref = state
    cref = fmp.compile(step, whole_graph=whole_graph)
    for bt in batches:
        ref, _ = cref(ref, *bt)
    state2, step2 = _setup(Recipe("delayed", history=4), fmp.DynamicLossScale(2.0 ** 8),
                           device="cuda", donate=True)
    graphed = fmp.cuda_graph(fmp.compile(step2, whole_graph=whole_graph), state2,
                             *batches[0], warmup=3)
    s = state2
    for bt in batches:
        s, _ = graphed(s, *bt)
    torch.testing.assert_close(s.params["0.weight"], ref.params["0.weight"], rtol=0, atol=0)
    torch.testing.assert_close(s.float8["0"].scale, ref.float8["0"].scale, rtol=0, atol=0)
    torch.testing.assert_close(s.float8["0"].amax_history, ref.float8["0"].amax_history,
                               rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_eager_delayed_step_trains_in_bf16():
    state, step = _setup(Recipe("delayed", history=4), device="cuda")
    x, t = torch.randn(32, 32, device="cuda"), torch.randn(32, 16, device="cuda")
    state, m = step(state, x, t)
    state, m = step(state, x, t)
    assert bool(m["grads_finite"]) and (state.float8["0"].scale != 1).all()


@pytest.mark.parametrize("policy, loss_scale", [("fp32", None),
                                                ("fp16-mixed", fmp.DynamicLossScale(2.0 ** 10)),
                                                ("bf16-mixed", None)])
def test_policies_train_with_delayed_records(policy, loss_scale):
    torch.manual_seed(0)
    net = fmp.float8.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                                 torch.nn.Linear(32, 16)), "delayed")
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.adam(1e-2)
    state = fmp.TrainState.create(params, opt, loss_scale, float8=fmp.float8.init(net))
    step = fmp.train_step(
        lambda p, x, y: torch.nn.functional.mse_loss(apply_fn(p, x).float(), y), opt, policy)
    x, y = torch.randn(32, 32), torch.randn(32, 16) * 0.5
    losses = []
    for _ in range(10):
        state, m = step(state, x, y)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.8 * losses[0], losses
    assert int(state.skipped_total) == 0
    r = state.float8["2"]
    assert (r.amax_history[:, 0] > 0).all() and (r.scale != 1.0).all()
