"""Issue 14 item 5: O2/O5 float32 masters follow the model's weights.

Apex made the masters lazily at the first backward, so weights loaded into the model after
``initialize`` (fine-tuning from pretrained weights) were the ones trained. Here the masters
exist from ``initialize`` on; they take the model's value wherever it was written since.
"""

from __future__ import annotations

import copy

import pytest
import torch

from adapters.apex.amp import Amp
from adapters.apex.amp._master import MASTER_KEY

F32 = torch.float32


def make(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                            torch.nn.Linear(8, 3))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def data(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(n)]


def train(amp, m, o, batches):
    for x, y in batches:
        o.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        o.step()


def bits(m):
    return [p.detach().clone() for p in m.parameters()]


def same(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def pretrained():
    m, _ = make(123)
    return {k: v.clone() for k, v in m.state_dict().items()}


def reference(level, batches, load=None):
    """Pretrained weights loaded *before* initialize: what Apex's order always gave."""
    amp = Amp()
    m, o = make(0)
    m.load_state_dict(pretrained())
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
    if load is not None:
        load(m, o)
    train(amp, m, o, batches)
    return bits(m), [p.detach().clone() for p in amp.master_params(o)]


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("how", ["load_state_dict", "no_grad_copy", "data_copy"])
def test_pretrained_weights_loaded_after_initialize_survive_the_first_step(level, how):
    batches = data(3)
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
    sd = pretrained()
    if how == "load_state_dict":
        m.load_state_dict(sd)  # fine-tuning from pretrained weights
    else:
        with torch.no_grad():
            for k, p in m.named_parameters():
                (p.data if how == "data_copy" else p).copy_(sd[k])
        for k, b in m.named_buffers():
            b.copy_(sd[k])
    train(amp, m, o, batches)
    ref_params, ref_masters = reference(level, batches)
    assert same(bits(m), ref_params)
    assert same(list(amp.master_params(o)), ref_masters)


def test_weights_written_mid_training_take_effect():
    batches = data(4)
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    train(amp, m, o, batches[:2])
    m.load_state_dict(pretrained())  # a restore into the live model
    # the optimizer's state (Adam's moments) is kept, as plain torch keeps it
    train(amp, m, o, batches[2:])
    masters = list(amp.master_params(o))
    for p, master in zip(m.parameters(), masters, strict=True):
        assert torch.equal(p, master.to(p.dtype))
    # the restored weights were trained, not the ones from before the restore
    ref = pretrained()
    moved = [(p.float() - ref[k].float()).abs().max().item()
             for k, p in m.named_parameters()]
    assert max(moved) < 0.1


def test_optimizer_state_loaded_before_the_model_apex_checkpoint():
    """An optimizer checkpoint without fmp's masters (Apex's, or torch's) then the model."""
    batches = data(3)
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    sd = o.state_dict()
    for st in sd["state"].values():
        st.pop(MASTER_KEY, None)
    o.load_state_dict(sd)  # masters rebuilt from the model as it is now
    m.load_state_dict(pretrained())  # then the model: it must win
    train(amp, m, o, batches)
    ref_params, _ = reference("O2", batches)
    assert same(bits(m), ref_params)


def test_exact_resume_optimizer_before_model_keeps_the_masters_bits():
    batches = data(6)
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    train(amp, m, o, batches[:3])
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": o.state_dict(),
                          "amp": amp.state_dict()})
    # the masters hold bits the float16 model cannot: a rebuild from it would lose them
    assert any(not torch.equal(master, p.float())
               for master, p in zip(amp.master_params(o), m.parameters(), strict=True))
    train(amp, m, o, batches[3:])
    amp2 = Amp()
    m2, o2 = make(7)
    m2, o2 = amp2.initialize(m2, o2, opt_level="O2", verbosity=0)
    o2.load_state_dict(ckpt["opt"])  # optimizer first, then the model
    m2.load_state_dict(ckpt["model"])
    amp2.load_state_dict(ckpt["amp"])
    train(amp2, m2, o2, batches[3:])
    assert same(bits(m2), bits(m))
    assert same(list(amp2.master_params(o2)), list(amp.master_params(o)))


def test_checkpoint_right_after_loading_pretrained_holds_them():
    amp = Amp()
    m, o = make(0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    train(amp, m, o, data(1))
    m.load_state_dict(pretrained())
    sd = o.state_dict()  # no step since the load: the masters saved are the loaded weights
    masters = amp._records[0].masters
    saved = 0
    for j, p in enumerate(o.param_groups[0]["params"]):
        model_p = masters.model_of.get(p)
        if model_p is not None:
            assert torch.equal(sd["state"][j][MASTER_KEY], model_p.float())
            saved += 1
    assert saved == 4  # the two Linear layers' weights and biases (batch-norm stays float32)
