"""fmp/_reparam.py: the eager forward's slot swap does what torch.func.functional_call does
(tied and shared tensors, errors, the module restored), and follows a module changed after
fmp.functional; fmp.copy_tree_ copies trees of mixed dtypes."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import fmp
from fmp._reparam import Slots
from tests.helpers import assert_trees_bit_equal


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.shared = torch.nn.Linear(3, 3)
        self.block = torch.nn.Sequential(self.shared, torch.nn.ReLU(), self.shared)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied, as language models do
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.head(self.block(self.emb(ids)))


def _new_values(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_swap_gives_functional_calls_output_and_grads_with_tied_and_shared_weights():
    torch.manual_seed(0)
    model = Tied()
    torch.manual_seed(0)
    ref = Tied()  # torch's functional_call runs on its own copy (see the end)
    ids = torch.tensor([[0, 3, 4]])
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    vals = _new_values(model)
    assert "head.weight" not in vals  # deduplicated, as fmp.functional's params
    for v in vals.values():
        v.requires_grad_()
    count = torch.zeros((), dtype=torch.int64)
    got = Slots(model).call(vals, {"count": count}, (ids,), {})
    # the module has its own tensors back (Parameters, not the values given)
    for n, p in model.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and torch.equal(p.detach(), own[n])
    assert model.head.weight is model.emb.weight
    assert int(model.count) == 0 and int(count) == 1  # the given buffer was updated
    want = functional_call(ref, (vals, {"count": torch.zeros((), dtype=torch.int64)}),
                           (ids,), tie_weights=True, strict=False)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got.sum(), list(vals.values()))
    g2 = torch.autograd.grad(want.sum(), list(vals.values()))
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
    # torch 2.13's functional_call leaves a submodule that appears under two names (here
    # shared, block.0, block.2) holding the given tensors: the reason to compare on a copy
    leaked = not isinstance(ref.shared.weight, torch.nn.Parameter)
    print("functional_call leaves the shared submodule swapped:", leaked)


def test_a_module_changed_after_resolving_is_resolved_again():
    model = Tied()
    slots = Slots(model)
    ids = torch.tensor([[1, 2]])
    model.block[0] = torch.nn.Linear(3, 3)  # a new submodule where the shared one was
    vals = {n: p.detach() + 1 for n, p in model.named_parameters()}
    got = slots.call(vals, None, (ids,), {})
    want = functional_call(model, vals, (ids,), tie_weights=True, strict=False)
    assert torch.equal(got, want)
    model.shared.weight = torch.nn.Parameter(torch.zeros(3, 3))  # a param replaced
    vals = {n: p.detach() * 2 for n, p in model.named_parameters()}
    assert torch.equal(slots.call(vals, None, (ids,), {}),
                       functional_call(model, vals, (ids,), tie_weights=True, strict=False))


def test_what_the_fast_path_does_not_take_gets_functional_calls_errors():
    model = Tied()
    slots = Slots(model)
    ids = torch.tensor([[1]])
    # a name the module lacks: functional_call (strict=False) sets it for the call
    out = slots.call({"nope": torch.ones(1)}, None, (ids,), {})
    assert out.shape == (1, 1, 5) and not hasattr(model, "nope")
    with pytest.raises(TypeError):
        slots.call({"shared.bias": 3.0}, None, (ids,), {})
    with pytest.raises(ValueError, match="tied"):
        slots.call({"emb.weight": torch.ones(5, 3), "head.weight": torch.zeros(5, 3)},
                   None, (ids,), {})
    assert isinstance(model.shared.bias, torch.nn.Parameter)


def test_the_module_is_restored_when_the_forward_raises():
    model = Tied()
    before = dict(model.named_parameters())
    with pytest.raises(IndexError):
        Slots(model).call(_new_values(model), None, (torch.tensor([[9]]),), {})
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[n] is after[n] for n in before)


class Reassigns(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = 0.5 * self.ema + 0.5 * x.mean(0).detach()  # assigned, not in place
        return self.lin(x)


def test_a_buffer_the_forward_assigns_is_carried_in_the_returned_buffers():
    model = Reassigns()
    apply_fn, params, buffers = fmp.functional(model)
    x = torch.tensor([[2.0, 4.0]])
    _, new = apply_fn(params, x, buffers=buffers, return_buffers=True)
    assert torch.equal(new["ema"], torch.tensor([1.0, 2.0]))
    assert torch.equal(buffers["ema"], torch.zeros(2)) and torch.equal(model.ema, torch.zeros(2))
    _, newer = apply_fn(params, x, buffers=new, return_buffers=True)
    assert torch.equal(newer["ema"], torch.tensor([1.5, 3.0]))
    assert torch.equal(new["ema"], torch.tensor([1.0, 2.0]))  # the input left as it was


def test_hugging_face_gpt2_forward_matches_functional_call():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    apply_fn, params, buffers = fmp.functional(model)
    ids = torch.randint(0, 64, (2, 8))
    vals = {n: p + 0.01 for n, p in params.items()}
    got = apply_fn(vals, ids).logits
    want = functional_call(model, (vals, buffers), (ids,), tie_weights=True).logits
    assert torch.equal(got, want)


def test_copy_tree_copies_with_conversion_and_names_a_bad_leaf():
    dst = {"w": torch.zeros(2, dtype=torch.float16), "n": torch.zeros((), dtype=torch.int64),
           "m": [torch.zeros(3)]}
    src = {"w": torch.tensor([0.1, 3.0]), "n": torch.tensor(7),
           "m": [torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)]}
    out = fmp.copy_tree_(dst, src)
    assert out is dst
    assert_trees_bit_equal(dst, {"w": src["w"].half(), "n": src["n"],
                                 "m": [src["m"][0].float()]})
    with pytest.raises(ValueError, match=r"leaf 'm\.0' is torch.float32 \(2,\) in src"):
        fmp.copy_tree_(dst, {**src, "m": [torch.ones(2)]})
    with pytest.raises(ValueError, match="differ in structure"):
        fmp.copy_tree_(dst, {"w": src["w"]})
    lists = [torch.zeros(2), torch.zeros((), dtype=torch.int64)]
    assert fmp.copy_tree_(lists, [torch.ones(2), torch.tensor(5)]) is lists
    assert torch.equal(lists[0], torch.ones(2)) and int(lists[1]) == 5
