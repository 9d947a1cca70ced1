"""The loss-scale records own unscaling: each path bit for bit as before and as torch.amp,
the caller's tensors never written through aliases or views, and one field table behind
both pytree registrations."""

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as tp

import fmp
from fmp import _records
from fmp.loss_scale._scaling import inverse

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def records():
    return [fmp.NoOpLossScale(), fmp.StaticLossScale(3.0), fmp.StaticLossScale(1024.0),
            fmp.DynamicLossScale.create(initial=2.0**16, min_scale=0.25)]


IDS = ["noop", "static3", "static1024", "dynamic"]


def scaled_grads(dtype=F32, seed=0, bad=None):
    g = torch.Generator().manual_seed(seed)
    out = {"w": (torch.randn(7, 5, generator=g) * 300).to(dtype),
           "b": (torch.randn(11, generator=g) * 300).to(dtype)}
    if bad is not None:
        out["b"][3] = bad
    return out


def scale_of(ls):
    return 1.0 if isinstance(ls, fmp.NoOpLossScale) else ls.loss_scale.item()


def clone(tree):
    return optree.tree_map(torch.clone, tree)


def same(a, b):
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y)
                                      for x, y in zip(la, lb, strict=True))


def pure_reference(grads, s, k):
    """Today's pure path: times the float32 reciprocal of s (in float32), then times 1/k."""
    inv = torch.tensor(s, dtype=F64).reciprocal().float()
    out = {n: ((g.float() if g.dtype.itemsize < 4 else g) * inv).to(g.dtype)
           for n, g in grads.items()}
    return out if k == 1 else {n: g * (1.0 / k) for n, g in out.items()}


def kernel_reference(grads, s, k):
    """torch's amp kernel, multiplying once by the reciprocal of s*k."""
    out = clone(grads)
    found = torch.zeros(1)
    inv = (torch.tensor(s, dtype=F32) * float(k)).double().reciprocal().float()
    torch._amp_foreach_non_finite_check_and_unscale_(list(out.values()), found, inv.reshape(1))
    return out, bool(found.item() == 0)


def gradscaler_unscale(grads, s):
    """torch.amp.GradScaler.unscale_ on params holding ``grads``."""
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt = torch.optim.SGD(params.values(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=s)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor here
    scaler.unscale_(opt)
    found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    return {n: p.grad for n, p in params.items()}, found == 0


@pytest.mark.parametrize("ls", records(), ids=IDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_in_place_equals_gradscaler_unscale(ls, dtype):
    grads = scaled_grads(dtype)
    want, want_ok = gradscaler_unscale(grads, scale_of(ls))
    given = clone(grads)
    out, ok = ls.unscale_and_check(given, in_place=True)
    assert same(out, want) and bool(ok) == want_ok is True
    assert all(out[n] is given[n] for n in given)  # written in place: no copy
    # GradScaler.unscale_'s contract on the caller's tensors gives the same bits
    mine = clone(grads)
    found = ls.unscale_and_check_(list(mine.values()))
    assert same(mine, want) and found.item() == 0.0


@pytest.mark.parametrize("ls", records(), ids=IDS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("k", [1, 3])
def test_each_path_keeps_its_numerics(ls, dtype, k):
    grads = scaled_grads(dtype, seed=k)
    before = clone(grads)
    out, ok = ls.unscale_and_check(grads, micro_batches=k)
    assert same(out, pure_reference(grads, scale_of(ls), k)) and bool(ok)
    assert same(grads, before)  # the pure path writes nothing
    assert same(ls.unscale(grads, micro_batches=k), out)
    want, want_ok = kernel_reference(grads, scale_of(ls), k)
    got, ok = ls.unscale_and_check(clone(grads), in_place=True, micro_batches=k)
    assert same(got, want) and bool(ok) == want_ok is True
    if k == 3 and dtype == F32 and scale_of(ls) == 3.0:
        assert not same(got, out)  # the test can tell the two numerics apart


def test_reciprocal_is_gradscalers():
    for s in (3.0, 7.0, 1e-3, 2.0**-20, 12345.678, 3.0e38):
        t = torch.tensor(s, dtype=F32)
        assert torch.equal(inverse(t), t.double().reciprocal().float())
        assert torch.equal(inverse(t), torch.reciprocal(t))  # the float32 one agrees


@pytest.mark.parametrize("ls", records(), ids=IDS)
def test_aliases_views_and_protected_tensors_are_never_written(ls):
    base = torch.full((8,), 6.0)
    shared = torch.full((4,), 6.0)
    param = torch.full((4,), 6.0)
    expanded = torch.full((1,), 6.0).expand(4)
    grads = {"a": shared, "b": shared, "view": base[:4], "exp": expanded, "p": param,
             "own": torch.full((4,), 6.0)}
    keep = {"base": base.clone(), "shared": shared.clone(), "param": param.clone(),
            "exp": expanded.clone()}
    out, ok = ls.unscale_and_check(grads, in_place=True, protect={"w": param})
    s = scale_of(ls)
    want = (torch.full((4,), 6.0) * torch.tensor(s).double().reciprocal().float())
    assert bool(ok) and all(torch.equal(v, want) for v in out.values())
    assert torch.equal(base, keep["base"]) and torch.equal(param, keep["param"])
    assert torch.equal(expanded, keep["exp"])
    # the shared tensor is written at most once (as one of the two grads), never twice
    assert torch.equal(shared, want) or torch.equal(shared, keep["shared"])
    assert out["a"] is not out["b"] and out["own"] is grads["own"]
    assert out["p"] is not param and out["view"]._base is None


def test_unscale_for_fused_in_place_or_divisor_and_read_only_check():
    ls = fmp.StaticLossScale(4.0)
    grads = scaled_grads(F32)
    mine = clone(grads)
    out, grad_scale, ok = ls.unscale_for_fused(mine, micro_batches=2)
    assert grad_scale is None and bool(ok) and same(out, kernel_reference(grads, 4.0, 2)[0])
    kept = clone(grads)
    out, grad_scale, ok = ls.unscale_for_fused(kept, micro_batches=2, check=fmp.all_finite)
    assert torch.equal(grad_scale, torch.tensor(8.0)) and bool(ok) and same(kept, grads)
    f64 = scaled_grads(F64)  # a dtype the one pass leaves to the pure numerics
    out, grad_scale, ok = ls.unscale_for_fused(clone(f64))
    assert torch.equal(grad_scale, torch.tensor(4.0)) and same(out, f64)
    noop = fmp.NoOpLossScale()
    assert noop.unscale_for_fused(clone(f64))[1] is None
    assert torch.equal(noop.unscale_for_fused(clone(f64), micro_batches=4)[1],
                       torch.tensor(4.0))


def test_noop_with_micro_batches():
    ls = fmp.NoOpLossScale()
    grads = scaled_grads(F32)
    assert ls.unscale(grads) is grads and ls.grad_divisor(grads) is None
    assert torch.equal(ls.grad_divisor(grads, micro_batches=4), torch.tensor(4.0))
    out, ok = ls.unscale_and_check(grads, micro_batches=4)
    assert bool(ok) and same(out, {n: g * 0.25 for n, g in grads.items()})
    mine = clone(grads)
    out, ok = ls.unscale_and_check(mine, in_place=True, micro_batches=3)
    assert bool(ok) and same(out, kernel_reference(grads, 1.0, 3)[0])
    assert out["w"] is mine["w"]
    out, ok = ls.unscale_and_check(mine, in_place=True)  # scale 1, one micro-batch: a check
    assert bool(ok) and same(out, kernel_reference(grads, 1.0, 3)[0])


@pytest.mark.parametrize("ls", records(), ids=IDS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_or_nan_gives_finite_false_on_every_path(ls, bad):
    grads = scaled_grads(F32, bad=bad)
    for kw in ({}, {"in_place": True}, {"micro_batches": 2}):
        _, ok = ls.unscale_and_check(clone(grads), **kw)
        assert ok.dtype == torch.bool and not bool(ok)
    assert not bool(ls.unscale_for_fused(clone(grads))[2])
    assert not bool(ls.unscale_for_fused(clone(grads), check=fmp.all_finite)[2])
    assert ls.unscale_and_check_(list(clone(grads).values())).item() == 1.0
    found = torch.zeros(())
    ls.unscale_and_check_(list(scaled_grads(F32).values()), found)
    ls.unscale_and_check_(list(clone(grads).values()), found)
    ls.unscale_and_check_(list(scaled_grads(F32).values()), found)
    assert found.item() == 1.0  # accumulates, never reset


def test_bf16_grads_on_cpu_take_the_one_pass():
    ls = fmp.StaticLossScale(3.0)
    grads = scaled_grads(BF16)
    mine = clone(grads)
    out, ok = ls.unscale_and_check(mine, in_place=True)
    assert out["w"] is mine["w"] and out["w"].dtype == BF16 and bool(ok)
    assert same(out, kernel_reference(grads, 3.0, 1)[0])
    # float64 grads keep the pure path: the input is not written
    f64 = scaled_grads(F64)
    before = clone(f64)
    out, ok = ls.unscale_and_check(f64, in_place=True, micro_batches=3)
    assert same(f64, before) and same(out, pure_reference(before, 3.0, 3))


def test_micro_batches_is_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
            fmp.StaticLossScale(2.0).unscale_and_check({"w": torch.ones(1)}, micro_batches=bad)


def test_unscale_and_check_writes_the_callers_views():
    base = torch.full((8,), 8.0)
    found = fmp.StaticLossScale(4.0).unscale_and_check_([base[:4]])
    assert found.item() == 0.0 and base.tolist() == [2.0] * 4 + [8.0] * 4


@pytest.mark.parametrize("ls", records(), ids=IDS)
def test_both_pytree_registrations_come_from_one_field_table(ls):
    leaves, meta = _records.field_table(type(ls))
    assert (leaves, meta) == (
        tuple(f.name for f in dataclasses.fields(ls) if f.name not in meta),
        tuple(f.name for f in dataclasses.fields(ls) if f.name not in leaves))
    kids = [getattr(ls, n) for n in leaves]
    ctx = tuple(getattr(ls, n) for n in meta) if meta else None
    o_kids, o_meta, o_entries, _ = optree.tree_flatten_one_level(ls)
    assert [id(x) for x in o_kids] == [id(x) for x in kids]
    assert o_meta == ctx and tuple(o_entries) == leaves
    t_kids, t_spec = tp.tree_flatten(ls)
    assert [id(x) for x in t_kids] == [id(x) for x in kids]
    assert t_spec.context == ctx
    keys = [k for k, _ in tp.tree_flatten_with_path(ls)[0]]
    assert keys == [(tp.GetAttrKey(n),) for n in leaves]
    assert [p for p, _ in zip(optree.tree_paths(ls), kids, strict=True)] == [(n,) for n in leaves]
    back = tp.tree_unflatten(t_kids, t_spec)
    again = optree.tree_unflatten(optree.tree_structure(ls), o_kids)
    for r in (back, again):
        assert type(r) is type(ls) and _records.as_dict(r).keys() == _records.as_dict(ls).keys()
        assert all(a is b for a, b in zip(optree.tree_leaves(r), kids, strict=True))


def test_register_generates_both_registrations_for_a_new_record():
    @dataclasses.dataclass(frozen=True)
    class Rec:
        x: torch.Tensor
        y: torch.Tensor
        n: int = _records.static(3)

    _records.register(Rec)
    r = Rec(torch.ones(1), torch.zeros(2), 5)
    assert _records.field_table(Rec) == (("x", "y"), ("n",))
    assert optree.tree_flatten_one_level(r)[1] == (5,) == tp.tree_flatten(r)[1].context
    doubled = tp.tree_map(lambda t: t * 2, r)
    assert type(doubled) is Rec and doubled.n == 5 and torch.equal(doubled.x, torch.full((1,), 2.0))
    mapped = optree.tree_map(lambda t: t + 1, r)
    assert mapped.n == 5 and torch.equal(mapped.y, torch.ones(2))


def test_records_pickle_under_their_public_path():
    import io

    for ls in records():
        assert type(ls).__module__ == "fmp.loss_scale"
        buf = io.BytesIO()
        torch.save(ls, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        assert type(back) is type(ls) and back.state_dict() == ls.state_dict()


@pytest.mark.cuda
def test_bf16_on_cuda_keeps_the_pure_path_and_the_adapter_contract_multiplies():
    dev = torch.device("cuda")
    ls = fmp.StaticLossScale(3.0, device=dev)
    grads = {n: g.to(dev) for n, g in scaled_grads(BF16).items()}
    before = clone(grads)
    out, ok = ls.unscale_and_check(grads, in_place=True, micro_batches=2)
    assert same(grads, before) and bool(ok)  # nothing written: the kernel rejects bf16
    assert same(out, ls.unscale(before, micro_batches=2))
    out, grad_scale, ok = ls.unscale_for_fused(clone(before))
    assert torch.equal(grad_scale, ls.loss_scale) and same(out, before)
    mine = [g.clone() for g in before.values()]
    assert ls.unscale_and_check_(mine).item() == 0.0
    inv = inverse(ls.loss_scale)
    for m, g in zip(mine, before.values(), strict=True):  # written, a multiply in bf16
        assert m.dtype == BF16 and not torch.equal(m, g)
        assert torch.allclose(m.float(), g.float() * inv, rtol=1e-2, atol=0)
