"""What dynamo traces of a step is cheap and still exact: the flat-dict short path of the
optimizer's flatten (fmp/_flat_dict.py) and the slot swap under torch.compile
(fmp/_reparam.py)."""

from __future__ import annotations

import optree
import pytest
import torch

import fmp
from fmp import _flat_dict


def _compiled(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_flat_dict_matches_optree_order_and_rebuilds_the_dict_order():
    tree = {"b.weight": torch.ones(2), "a": torch.zeros(3), "c.bias": torch.full((1,), 2.0)}

    def go(t):
        leaves, spec = _flat_dict.flatten(t)
        doubled = [x * 2 for x in leaves]
        return _flat_dict.unflatten(spec, doubled), _flat_dict.leaves(t)

    out, leaves = _compiled(go)(tree)
    ref_leaves, ref_spec = optree.tree_flatten(tree)
    ref = optree.tree_unflatten(ref_spec, [x * 2 for x in ref_leaves])
    assert list(out) == list(ref) == list(tree)  # the dict's own key order
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert [x.shape for x in leaves] == [x.shape for x in ref_leaves]
    assert all(torch.equal(a, b) for a, b in zip(leaves, ref_leaves, strict=True))


@pytest.mark.parametrize("tree", [
    {"a": torch.ones(1), "b": None},            # None is no leaf to optree
    {"a": torch.ones(1), "b": {"c": torch.ones(2)}},
    {1: torch.ones(1), 0: torch.ones(2)},       # keys not all str
    [torch.ones(1), torch.ones(2)],
    (torch.ones(3),),
])
def test_other_trees_go_through_optree_under_compile(tree):
    def go(t):
        leaves, spec = _flat_dict.flatten(t)
        return leaves, isinstance(spec, _flat_dict.DictSpec)

    leaves, short = _compiled(go)(tree)
    assert not short
    ref = optree.tree_leaves(tree)
    assert len(leaves) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(leaves, ref, strict=True))


def test_outside_dynamo_flatten_is_optree_itself():
    tree = {"b": torch.ones(1), "a": torch.zeros(1)}
    leaves, spec = _flat_dict.flatten(tree)
    assert spec == optree.tree_flatten(tree)[1]
    assert _flat_dict.unflatten(spec, leaves).keys() == tree.keys()


def test_unflatten_names_a_leaf_count_mismatch():
    spec = _flat_dict.DictSpec(("a", "b"), ("b", "a"))
    with pytest.raises(ValueError, match="1 leaves for a spec of 2 keys"):
        _flat_dict.unflatten(spec, [torch.ones(1)])


def _mlp_step(model):
    apply_fn, params, _ = fmp.functional(model)
    opt = fmp.optim.adamw(1e-2, weight_decay=0.1)

    def loss_fn(p, x, y):
        return ((apply_fn(p, x) - y) ** 2).mean()

    return fmp.train_step(loss_fn, opt, "bf16-mixed"), params, opt


def test_compiled_step_through_the_slot_swap_matches_eager_and_leaves_the_module_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    own = {n: p for n, p in model.named_parameters()}
    step, params, opt = _mlp_step(model)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    eager_state = fmp.TrainState.create(params, opt)
    comp_state = fmp.TrainState.create({k: v.clone() for k, v in params.items()}, opt)
    compiled = fmp.compile(step, backend="eager")
    for _ in range(3):
        eager_state, em = step(eager_state, x, y)
        comp_state, cm = compiled(comp_state, x, y)
        assert torch.equal(em["loss"], cm["loss"])
    for k in params:
        assert torch.equal(eager_state.params[k], comp_state.params[k]), k
    # the module's own slots hold its own params again after the compiled calls
    assert all(p is own[n] for n, p in model.named_parameters())


def test_compiled_forward_follows_a_submodule_replaced_after_the_first_call():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    apply_fn, params, _ = fmp.functional(model)
    f = torch.compile(apply_fn, backend="eager", fullgraph=True)
    x = torch.randn(2, 3)
    assert torch.equal(f(params, x), torch.func.functional_call(model, params, (x,)))
    model[1] = torch.nn.Linear(3, 1)  # same names, new module: the slots resolve again
    new = {**params, "1.weight": torch.randn(1, 3), "1.bias": torch.randn(1)}
    assert torch.equal(f(new, x), torch.func.functional_call(model, new, (x,)))
    assert model[1].weight is not new["1.weight"]  # restored after the call


def test_a_buffer_registered_later_is_among_the_default_buffers():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            out = self.lin(x)
            if hasattr(self, "seen"):
                self.seen.add_(1)
            return out

    model = Counter()
    apply_fn, params, _ = fmp.functional(model)
    x = torch.ones(1, 2)
    apply_fn(params, x)
    model.register_buffer("seen", torch.zeros(()))
    _, bufs = apply_fn(params, x, return_buffers=True)
    assert set(bufs) == {"seen"} and float(bufs["seen"]) == 1.0
    assert float(model.seen) == 0.0  # the copy was counted, not the module's own


def test_all_owned_fast_answer_agrees_with_the_leaf_by_leaf_rule():
    from fmp import _donation

    mine = [torch.ones(2), torch.zeros(())]
    _donation.claim(mine)
    foreign = torch.ones(3)
    assert _donation.all_owned({"a": mine[0], "b": mine[1]})
    assert not _donation.all_owned({"a": mine[0], "f": foreign})
    assert _donation.all_owned((mine, 3.0, None))  # non-tensor leaves are nobody's
    assert not _donation.all_owned((mine, 3.0, foreign))
    # an entry left under a dead tensor's id never vouches for another object
    gone = torch.ones(1)
    _donation.claim([gone])
    k = id(gone)
    del gone
    assert k not in _donation._OWNED
    stale = torch.ones(1)
    _donation._OWNED[id(stale)] = _donation._NO_REF  # as if an entry outlived its tensor
    try:
        assert not _donation.all_owned([stale])
    finally:
        _donation._OWNED.pop(id(stale), None)


def test_the_update_graph_alone_compiles_with_the_narrower_fusion_search():
    import torch._inductor.config as ic

    from fmp._compile import UPDATE_OPTIONS

    seen = []

    def backend(gm, example_inputs):
        seen.append(ic.max_fusion_buffer_group_pairwise_attempts)
        return gm.forward

    default = ic.max_fusion_buffer_group_pairwise_attempts
    model = torch.nn.Linear(3, 2)
    step, params, opt = _mlp_step(model)
    state = fmp.TrainState.create(params, opt)
    compiled = fmp.compile(step, backend=backend)
    compiled(state, torch.randn(4, 3), torch.randn(4, 2))
    want = UPDATE_OPTIONS["max_fusion_buffer_group_pairwise_attempts"]
    assert seen[0] == default and seen[-1] == want != default, seen
    assert ic.max_fusion_buffer_group_pairwise_attempts == default  # nothing leaks


def test_slot_plans_stay_few_when_the_given_names_vary():
    from fmp import _reparam

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(12)])
    slots = _reparam.Slots(model)
    params = dict(model.named_parameters())
    x = torch.ones(1, 2)
    for i in range(12):  # a different subset of names each call
        given = {k: v.detach() * 0 for k, v in params.items() if k.startswith(f"{i}.")}
        out = slots.call(given, None, (x,), {})
        ref = torch.func.functional_call(model, given, (x,))
        assert torch.equal(out, ref)
    assert len(slots._plans) <= _reparam._PLANS_KEPT
