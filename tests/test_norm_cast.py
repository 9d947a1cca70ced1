"""Norm layers kept in float32 under the mixed presets meet 16-bit activations.

On CUDA, ``layer_norm`` and ``group_norm`` take one dtype for input and params; the mixed
presets keep norm params in float32 while the activations are float16 / bfloat16, so every
transformer (GPT-2 of benchmarks/models.py, Hugging Face's GPT-2) failed on the GPU with
"expected scalar type Half but found Float". Inside ``apply_fn`` such a norm now computes
in its params' dtype and hands back its input's dtype. The CPU tests check the dtypes every
norm call sees and the values against a hand-written float32 norm; the CUDA ones train.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fmp

NORM_FNS = {"layer_norm", "group_norm", "rms_norm"}


class _Recorder(TorchFunctionMode):
    """Records (op, input dtype, param dtypes, output dtype) of every norm call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, tuple[torch.dtype, ...], torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in NORM_FNS:
            params = tuple(a.dtype for a in (*args[1:], *kwargs.values())
                           if isinstance(a, torch.Tensor))
            self.calls.append((name, args[0].dtype, params, out.dtype))
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.gn = torch.nn.GroupNorm(4, 16)
        self.rms = torch.nn.RMSNorm(16) if hasattr(torch.nn, "RMSNorm") else torch.nn.Identity()
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.inp(x))
        h = self.gn(h.unsqueeze(-1)).squeeze(-1)
        return self.out(self.rms(torch.relu(h)))


def _hand_forward(p: dict[str, torch.Tensor], x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The forward the step must compute: linears in ``dt``, each norm in float32 on the
    activation cast up, cast back to ``dt``."""
    h = F.linear(x.to(dt), p["inp.weight"].to(dt), p["inp.bias"].to(dt))
    h = F.layer_norm(h.float(), (16,), p["ln.weight"], p["ln.bias"]).to(dt)
    h = F.group_norm(h.unsqueeze(-1).float(), 4, p["gn.weight"], p["gn.bias"]).squeeze(-1).to(dt)
    h = torch.relu(h)
    if "rms.weight" in p:
        h = F.rms_norm(h.float(), (16,), p["rms.weight"]).to(dt)
    return F.linear(h, p["out.weight"].to(dt), p["out.bias"].to(dt))


def _step(policy: str, device: str = "cpu"):
    torch.manual_seed(0)
    net = Net().to(device)
    apply_fn, params, _ = fmp.functional(net)
    opt = fmp.optim.sgd(0.1)

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x).float(), y)

    scale = fmp.DynamicLossScale.create() if policy == "fp16-mixed" else None
    state = fmp.TrainState.create({k: v.clone() for k, v in params.items()}, opt, scale)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g).to(device)
    y = torch.randint(0, 3, (6,), generator=g).to(device)
    return fmp.train_step(loss_fn, opt, policy), state, x, y, net, apply_fn


@pytest.mark.parametrize("policy,dt", [("fp16-mixed", torch.float16),
                                       ("bf16-mixed", torch.bfloat16)])
def test_norms_compute_in_float32_and_hand_back_the_activation_dtype(policy, dt):
    step, state, x, y, _, _ = _step(policy)
    rec = _Recorder()
    with rec:
        new, m = step(state, x, y)
    n_norms = 3 if hasattr(torch.nn, "RMSNorm") else 2
    forward = rec.calls[:n_norms]
    assert [c[0] for c in forward] == ["layer_norm", "group_norm", "rms_norm"][:n_norms]
    for name, x_dt, p_dts, out_dt in rec.calls:
        # one dtype per call, float32 (the CUDA kernels take nothing else)
        assert x_dt == torch.float32 and set(p_dts) == {torch.float32}, (name, x_dt, p_dts)
        assert out_dt == torch.float32
    # the params the step kept in float32 are the norms', and the loss is the hand forward's
    want = F.cross_entropy(_hand_forward(state.params, x, dt).float(), y)
    assert torch.equal(m["loss"], want), (float(m["loss"]), float(want))
    assert all(new.params[k].dtype == torch.float32 for k in new.params)


def test_the_hooks_do_nothing_outside_apply_fn():
    _, _, x, _, net, _ = _step("fp16-mixed")
    h = net.inp(x).to(torch.bfloat16)  # bfloat16 input, float32 params: a plain module call
    rec = _Recorder()
    with rec:
        out = net.ln(h)
    assert rec.calls == [("layer_norm", torch.bfloat16, (torch.float32, torch.float32),
                          out.dtype)]
    assert torch.equal(out, F.layer_norm(h, (16,), net.ln.weight, net.ln.bias))


def test_a_copied_module_is_hooked_once():
    net = Net()
    fmp.functional(net)
    twin = copy.deepcopy(net)
    fmp.functional(twin)
    fmp.functional(twin)
    assert len(twin.ln._forward_pre_hooks) == 1 and len(twin.ln._forward_hooks) == 1
    apply_fn, params, _ = fmp.functional(twin)
    p = {k: (v if k.startswith(("ln.", "gn.", "rms.")) else v.to(torch.bfloat16))
         for k, v in params.items()}
    x = torch.randn(2, 8)
    out = apply_fn(p, x.to(torch.bfloat16))
    assert torch.equal(out, _hand_forward(params, x, torch.bfloat16))


@pytest.mark.slow
def test_compiled_step_with_norms_equals_eager():
    step, state, x, y, _, _ = _step("bf16-mixed")
    cstep = fmp.compile(step, backend="aot_eager")
    a, c = state, state
    for _ in range(2):
        a, ma = step(a, x, y)
        c, mc = cstep(c, x, y)
    assert torch.equal(ma["loss"], mc["loss"])
    for k in a.params:
        assert torch.equal(a.params[k], c.params[k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed"])
def test_cuda_norm_layers_train_under_the_mixed_presets(policy):
    step, state, x, y, _, _ = _step(policy, "cuda")
    dt = torch.float16 if policy == "fp16-mixed" else torch.bfloat16
    want = F.cross_entropy(_hand_forward(state.params, x, dt).float(), y)
    losses = []
    for _ in range(5):
        state, m = step(state, x, y)
        losses.append(float(m["loss"]))
    torch.testing.assert_close(torch.tensor(losses[0]), want.cpu(), rtol=1e-3, atol=1e-3)
    assert losses[-1] < losses[0], losses


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["fp16-mixed", "bf16-mixed"])
def test_cuda_hugging_face_gpt2_trains_under_the_mixed_presets(policy):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                  n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().train()
    apply_fn, params, _ = fmp.functional(model)
    opt = fmp.optim.adamw(1e-2)

    def loss_fn(p, ids):
        return apply_fn(p, input_ids=ids, labels=ids).loss

    scale = fmp.DynamicLossScale.create() if policy == "fp16-mixed" else None
    state = fmp.TrainState.create(params, opt, scale)
    step = fmp.train_step(loss_fn, opt, policy)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []
    for _ in range(8):
        state, m = step(state, ids)
        losses.append(float(m["loss"]))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.3, losses
    assert state.params["transformer.ln_f.weight"].dtype == torch.float32
