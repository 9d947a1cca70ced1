"""Loss scales: torch.amp parity, bounds, hysteresis, metadata through every transform,
state-dict round trips, validation, and the dtype rules of scale/unscale."""

import io
import math
import random
import struct

import optree
import pytest
import torch
import torch.utils._pytree as tp
from hypothesis import given, settings
from hypothesis import strategies as st

from fmp.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_from_state_dict,
)

T = torch.tensor(True)
F = torch.tensor(False)
I32 = torch.int32
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


def flags(bits):
    return [T if b else F for b in bits]


def torch_trajectory(bits, initial, factor, period):
    """(scale, growth tracker) after each step of torch._amp_update_scale_ on CPU."""
    scale = torch.tensor([initial], dtype=torch.float32)
    tracker = torch.zeros(1, dtype=I32)
    out = []
    for b in bits:
        found_inf = torch.tensor([0.0 if b else 1.0])
        torch._amp_update_scale_(scale, tracker, found_inf, factor, 1.0 / factor, period)
        out.append((scale.item(), tracker.item()))
    return out


def our_trajectory(ls, bits):
    out = []
    for b in bits:
        ls = ls.adjust(T if b else F)
        assert ls.loss_scale.dtype == torch.float32 and ls.counter.dtype == I32
        out.append((ls.loss_scale.item(), ls.counter.item()))
    return out


def wide(initial=2.0**16, factor=2.0, period=3, **kw):
    """A dynamic scale whose bounds do not interfere with a parity run."""
    return DynamicLossScale.create(initial=initial, period=period, factor=factor,
                                   min_scale=2.0**-126, max_scale=2.0**127, **kw)


def same_record(a, b):
    assert type(a) is type(b)
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


# --------------------------------------------------------------------------------------
# torch.amp parity (hysteresis=1)
# --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    bits=st.lists(st.booleans(), min_size=1, max_size=60),
    factor=st.sampled_from([2.0, 3.0, 1.5, 1.1, 1.0001, 1.7]),
    period=st.integers(1, 5),
    initial=st.sampled_from([2.0**16, 1.0, 3.0, 1000.0, 0.1]),
)
def test_parity_with_torch_amp_update_scale(bits, factor, period, initial):
    # 60 steps of factor <= 3 from <= 2**16 cannot reach 2**127 nor leave the normals.
    ours = our_trajectory(wide(initial, factor, period), bits)
    assert ours == torch_trajectory(bits, initial, factor, period)


def test_parity_non_power_of_two_factor_needs_double_product():
    # torch multiplies the float32 scale by a *double* factor and rounds once; a float32
    # product (scale * float32(1/3)) drifts from it within a few steps.
    rng = random.Random(1)
    bits = [rng.random() < 0.5 for _ in range(300)]
    ref = torch_trajectory(bits, 2.0**16, 3.0, 1)
    assert our_trajectory(wide(factor=3.0, period=1), bits) == ref
    s, naive = torch.tensor(2.0**16), []
    for b in bits:
        s = s * 3.0 if b else s * (1.0 / 3.0)
        naive.append(s.item())
    assert naive != [r[0] for r in ref]


def test_parity_long_sequence_period_3():
    g = torch.Generator().manual_seed(3)
    bits = (torch.rand(5000, generator=g) < 0.8).tolist()
    ref = torch_trajectory(bits, 2.0**16, 2.0, 3)
    ours = our_trajectory(wide(period=3), bits)
    assert ours == ref
    scales = {s for s, _ in ref}
    assert len(scales) > 10  # the sequence really moves the scale both ways


def test_parity_default_period_sampled():
    bits = [True] * 6000
    for i in (2500, 2501, 4990):
        bits[i] = False
    ref = torch_trajectory(bits, 2.0**16, 2.0, 2000)
    ls = DynamicLossScale.create(min_scale=2.0**-126, max_scale=2.0**127)
    assert (ls.period, ls.factor) == (2000, 2.0)
    for i, b in enumerate(bits):
        ls = ls.adjust(T if b else F)
        if i % 97 == 0 or i in (1998, 1999, 2000, 2500, 2501, 4501, 4502, 4990, 5999):
            assert (ls.loss_scale.item(), ls.counter.item()) == ref[i], i
    assert ref[1999] == (2.0**17, 0)
    assert (ls.loss_scale.item(), ls.counter.item()) == ref[-1] == (2.0**15, 1009)


def test_cap_at_2_127_matches_torch_refusing_inf():
    bits = [True] * 150
    ref = torch_trajectory(bits, 2.0**16, 2.0, 1)
    assert ref[-1][0] == 2.0**127
    assert our_trajectory(wide(period=1), bits) == ref


# --------------------------------------------------------------------------------------
# Growth, cap, floor, hysteresis
# --------------------------------------------------------------------------------------


def test_growth_after_period_clean_steps():
    ls = DynamicLossScale.create(initial=8.0, period=3)
    got = our_trajectory(ls, [True] * 7)
    assert got == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (16.0, 2), (32.0, 0), (32.0, 1)]


def test_overflow_shrinks_and_resets_counter():
    ls = DynamicLossScale.create(initial=8.0, period=3)
    got = our_trajectory(ls, [True, True, False, True, True, True])
    assert got == [(8.0, 1), (8.0, 2), (4.0, 0), (4.0, 1), (4.0, 2), (8.0, 0)]


def test_cap_at_max_scale_never_inf():
    ls = DynamicLossScale.create(initial=2.0**23, period=1, max_scale=2.0**24)
    assert [s for s, _ in our_trajectory(ls, [True] * 4)] == [2.0**24] * 4
    ls = DynamicLossScale.create(initial=2.0**127, period=1, max_scale=FLT_MAX)
    for _ in range(3):
        ls = ls.adjust(T)
        assert ls.loss_scale.item() == FLT_MAX and torch.isfinite(ls.loss_scale)
    # a cap that is not a power of two
    ls = DynamicLossScale.create(initial=1.0, period=1, max_scale=5.0)
    assert [s for s, _ in our_trajectory(ls, [True] * 4)] == [2.0, 4.0, 5.0, 5.0]


def test_floor_at_min_scale():
    ls = DynamicLossScale.create(initial=4.0, min_scale=0.25)
    got = [s for s, _ in our_trajectory(ls, [False] * 6)]
    assert got == [2.0, 1.0, 0.5, 0.25, 0.25, 0.25]
    ls = DynamicLossScale.create(initial=4.0)  # default floor 1
    assert [s for s, _ in our_trajectory(ls, [False] * 4)] == [2.0, 1.0, 1.0, 1.0]


def test_floor_not_a_float32_value_applies_as_nearest_float32():
    ls = DynamicLossScale.create(initial=1.0, min_scale=0.1)
    for _ in range(10):
        ls = ls.adjust(F)
    assert ls.loss_scale.item() == torch.tensor(0.1).item()
    assert DynamicLossScale.from_state_dict(ls.state_dict()).loss_scale.item() == \
        ls.loss_scale.item()


def test_hysteresis_2_trajectory():
    ls = DynamicLossScale.create(initial=16.0, period=3, hysteresis=2)
    seq = [False, False, False, True, False, False, True, True, True, False, True, False]
    expected = [  # (scale, counter, overflows) after each step
        (16.0, 0, 1),
        (8.0, 0, 0),
        (8.0, 0, 1),
        (8.0, 1, 0),   # a finite step forgives the pending overflow
        (8.0, 0, 1),
        (4.0, 0, 0),
        (4.0, 1, 0),
        (4.0, 2, 0),
        (8.0, 0, 0),
        (8.0, 0, 1),
        (8.0, 1, 0),
        (8.0, 0, 1),
    ]
    got = []
    for b in seq:
        ls = ls.adjust(T if b else F)
        got.append((ls.loss_scale.item(), ls.counter.item(), ls.overflows.item()))
    assert got == expected


def test_hysteresis_3_trajectory_and_floor():
    ls = DynamicLossScale.create(initial=2.0, period=2, min_scale=1.0, hysteresis=3)
    seq = [False, False, False, False, False, True, False, False, False, True, True]
    expected = [
        (2.0, 0, 1),
        (2.0, 0, 2),
        (1.0, 0, 0),
        (1.0, 0, 1),
        (1.0, 0, 2),
        (1.0, 1, 0),
        (1.0, 0, 1),
        (1.0, 0, 2),
        (1.0, 0, 0),   # the third overflow acts, but the floor holds
        (1.0, 1, 0),
        (2.0, 0, 0),
    ]
    got = []
    for b in seq:
        ls = ls.adjust(T if b else F)
        got.append((ls.loss_scale.item(), ls.counter.item(), ls.overflows.item()))
    assert got == expected


def python_model(bits, initial, period, hysteresis, lo, hi):
    """The documented rule in plain Python (exact for factor 2 within float32 range)."""
    s, c, o, out = initial, 0, 0, []
    for b in bits:
        if b:
            c, o = c + 1, 0
            if c >= period:
                s, c = min(s * 2, hi), 0
        else:
            c, o = 0, o + 1
            if o >= hysteresis:
                s, o = max(s / 2, lo), 0
        out.append((s, c, o))
    return out


@settings(max_examples=60, deadline=None)
@given(
    bits=st.lists(st.booleans(), min_size=1, max_size=50),
    period=st.integers(1, 4),
    hysteresis=st.integers(1, 4),
)
def test_hysteresis_against_python_model(bits, period, hysteresis):
    ls = DynamicLossScale.create(initial=8.0, period=period, min_scale=0.5, max_scale=64.0,
                                 hysteresis=hysteresis)
    got = []
    for b in bits:
        ls = ls.adjust(T if b else F)
        got.append((ls.loss_scale.item(), ls.counter.item(), ls.overflows.item()))
    assert got == python_model(bits, 8.0, period, hysteresis, 0.5, 64.0)


def test_adjust_accepts_python_bool_and_rejects_other_flags():
    ls = DynamicLossScale.create(initial=8.0)
    assert ls.adjust(False).loss_scale.item() == 4.0
    for bad in (torch.tensor(1.0), torch.tensor([True]), torch.tensor(1), 1, None):
        with pytest.raises(ValueError, match="0-d bool tensor"):
            ls.adjust(bad)


def test_adjust_returns_new_record_input_unchanged():
    ls = DynamicLossScale.create(initial=8.0, period=2)
    before = ls.state_dict()
    new = ls.adjust(F)
    assert new is not ls and ls.state_dict() == before
    assert new.loss_scale.item() == 4.0


def test_static_and_noop_adjust_return_self():
    for ls in (StaticLossScale(8.0), NoOpLossScale()):
        assert ls.adjust(F) is ls
        assert ls.adjust(T) is ls


# --------------------------------------------------------------------------------------
# Pytree structure and metadata through transforms
# --------------------------------------------------------------------------------------


def floor_record():
    return DynamicLossScale.create(initial=4.0, period=3, factor=2.0, min_scale=0.25,
                                   max_scale=1024.0, hysteresis=2)


META = (3, 2.0, 0.25, 1024.0, 2)


def meta(ls):
    return (ls.period, ls.factor, ls.min_scale, ls.max_scale, ls.hysteresis)


def test_dynamic_leaves_are_exactly_the_three_tensors():
    ls = floor_record()
    for leaves in (optree.tree_leaves(ls), tp.tree_leaves(ls)):
        assert len(leaves) == 3
        assert leaves[0] is ls.loss_scale and leaves[1] is ls.counter
        assert leaves[2] is ls.overflows
        assert [x.dtype for x in leaves] == [torch.float32, I32, I32]
        assert all(x.shape == () for x in leaves)
    paths = optree.tree_paths(ls)
    assert paths == [("loss_scale",), ("counter",), ("overflows",)]
    keys = [k for k, _ in tp.tree_flatten_with_path(ls)[0]]
    assert keys == [(tp.GetAttrKey("loss_scale"),), (tp.GetAttrKey("counter"),),
                    (tp.GetAttrKey("overflows"),)]


def test_static_and_noop_leaves():
    st_ = StaticLossScale(128.0)
    assert optree.tree_leaves(st_) == [st_.loss_scale] and tp.tree_leaves(st_) == [st_.loss_scale]
    assert st_.loss_scale.dtype == torch.float32 and st_.loss_scale.shape == ()
    assert optree.tree_leaves(NoOpLossScale()) == [] and tp.tree_leaves(NoOpLossScale()) == []
    one = NoOpLossScale().loss_scale
    assert one.dtype == torch.float32 and one.shape == () and one.item() == 1.0
    assert isinstance(optree.tree_map(lambda x: x, NoOpLossScale()), NoOpLossScale)


def test_metadata_survives_optree_flatten_unflatten_and_tree_map():
    ls = floor_record()
    leaves, spec = optree.tree_flatten(ls)
    back = optree.tree_unflatten(spec, leaves)
    assert isinstance(back, DynamicLossScale) and meta(back) == META
    mapped = optree.tree_map(lambda x: x.clone(), ls)
    assert meta(mapped) == META and torch.equal(mapped.loss_scale, ls.loss_scale)
    other = DynamicLossScale.create(initial=4.0, period=3, min_scale=0.5, max_scale=1024.0,
                                    hysteresis=2)
    assert optree.tree_structure(other) != spec  # hyper-parameters are part of the structure


def test_metadata_survives_torch_pytree_and_treespec_serialization():
    ls = floor_record()
    leaves, spec = tp.tree_flatten(ls)
    assert meta(tp.tree_unflatten(leaves, spec)) == META
    spec2 = tp.treespec_loads(tp.treespec_dumps(spec))
    assert spec2 == spec
    assert meta(tp.tree_unflatten(leaves, spec2)) == META
    assert meta(tp.tree_map(lambda x: x + 0, ls)) == META


def drive_down(ls, n=10):
    for _ in range(n):
        ls = ls.adjust(torch.zeros((), dtype=torch.bool))
    return ls


def test_metadata_survives_vmap():
    ls = floor_record()
    batched = optree.tree_map(lambda x: torch.stack([x, x, x]), ls)
    finite = torch.tensor([True, False, False])
    out = torch.func.vmap(lambda r, f: r.adjust(f).adjust(f))(batched, finite)
    assert isinstance(out, DynamicLossScale) and meta(out) == META
    assert out.loss_scale.tolist() == [4.0, 2.0, 2.0]
    assert out.counter.tolist() == [2, 0, 0] and out.overflows.tolist() == [0, 0, 0]
    assert out.counter.dtype == I32
    deep = torch.func.vmap(drive_down)(batched)
    assert deep.loss_scale.tolist() == [0.25] * 3 and meta(deep) == META


def test_metadata_survives_grad_with_record_in_and_out():
    ls = floor_record()

    def loss(x, r):
        return r.scale((x * x).sum()), drive_down(r)

    g, aux = torch.func.grad(loss, has_aux=True)(torch.tensor([1.0, 2.0]), ls)
    assert torch.equal(g, torch.tensor([8.0, 16.0]))  # d(4 * sum x^2)/dx
    assert isinstance(aux, DynamicLossScale) and meta(aux) == META
    assert aux.loss_scale.item() == 0.25


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_metadata_survives_compile_fullgraph(backend):
    torch._dynamo.reset()
    ls = floor_record()
    out = torch.compile(drive_down, fullgraph=True, backend=backend)(ls)
    assert isinstance(out, DynamicLossScale) and meta(out) == META
    assert out.loss_scale.item() == 0.25 and out.loss_scale.dtype == torch.float32
    assert out.counter.dtype == I32 and out.overflows.dtype == I32

    def up(r):
        for _ in range(4):
            r = r.adjust(torch.ones((), dtype=torch.bool))
        return r

    near_cap = DynamicLossScale.create(initial=512.0, period=1, min_scale=0.25,
                                       max_scale=1024.0)
    top = torch.compile(up, fullgraph=True, backend=backend)(near_cap)
    assert top.loss_scale.item() == 1024.0 and top.counter.item() == 0
    assert meta(top) == meta(near_cap)


@pytest.mark.slow
def test_inductor_matches_eager_and_keeps_floor():
    torch._dynamo.reset()
    bits = torch.tensor([True, True, False, True, True, True] + [False] * 10)
    ls = DynamicLossScale.create(initial=4.0, period=2, factor=3.0, min_scale=0.25,
                                 max_scale=2.0**20, hysteresis=2)

    def run(r, fs):
        scales = []
        for i in range(fs.shape[0]):
            r = r.adjust(fs[i])
            scales.append(r.loss_scale)
        return r, torch.stack(scales)

    want, want_scales = run(ls, bits)
    assert want.loss_scale.item() == 0.25
    assert want_scales[:8].tolist() == [4.0, 12.0, 12.0, 12.0, 36.0, 36.0, 36.0, 12.0]
    got, got_scales = torch.compile(run, fullgraph=True, backend="inductor")(ls, bits)
    same_record(got, want)
    assert torch.equal(got_scales, want_scales)  # 4/3, 4/9... rounded like eager
    assert meta(got) == meta(ls)


# --------------------------------------------------------------------------------------
# state_dict round trips
# --------------------------------------------------------------------------------------


def records():
    dyn = DynamicLossScale.create(initial=1000.0, period=5, factor=3.0, min_scale=0.125,
                                  max_scale=1e7, hysteresis=3)
    for b in (True, False, True, True, False, True, True):
        dyn = dyn.adjust(T if b else F)
    return [NoOpLossScale(), StaticLossScale(3.0e-3), dyn]


@pytest.mark.parametrize("i", range(3))
def test_state_dict_round_trip_bit_exact(i):
    ls = records()[i]
    d = ls.state_dict()
    assert d["type"] == type(ls).__name__
    for back in (type(ls).from_state_dict(d), loss_scale_from_state_dict(d)):
        same_record(back, ls)
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == d
    same_record(type(ls).from_state_dict(loaded), ls)


def test_dynamic_state_dict_contents():
    ls = records()[2]
    d = ls.state_dict()
    assert set(d) == {"type", "loss_scale", "counter", "overflows", "period", "factor",
                      "min_scale", "max_scale", "hysteresis"}
    assert type(d["loss_scale"]) is float and type(d["counter"]) is int
    assert type(d["overflows"]) is int
    assert d["loss_scale"] == ls.loss_scale.item() != 1000.0 / 3  # a float32 value, not f64
    assert (d["counter"], d["overflows"]) == (2, 0)
    assert (d["period"], d["factor"], d["min_scale"], d["max_scale"], d["hysteresis"]) == \
        (5, 3.0, 0.125, 1e7, 3)
    mid = DynamicLossScale.create(hysteresis=3).adjust(F).adjust(F)
    assert mid.state_dict()["overflows"] == 2
    same_record(DynamicLossScale.from_state_dict(mid.state_dict()), mid)
    # tensors are accepted as values too
    t = dict(d, loss_scale=ls.loss_scale, counter=ls.counter, overflows=ls.overflows)
    same_record(DynamicLossScale.from_state_dict(t), ls)


@pytest.mark.parametrize(
    ("cls", "d", "match"),
    [
        (NoOpLossScale, {}, r"missing keys \['type'\]"),
        (NoOpLossScale, {"type": "NoOpLossScale", "scale": 1.0}, r"unknown keys \['scale'\]"),
        (StaticLossScale, {"type": "StaticLossScale"}, r"missing keys \['loss_scale'\]"),
        (StaticLossScale, {"type": "StaticLossScale", "loss_scale": 2.0, "x": 1, "y": 2},
         r"unknown keys \['x', 'y'\]"),
        (StaticLossScale, {"type": "DynamicLossScale", "loss_scale": 2.0},
         "'DynamicLossScale', not 'StaticLossScale'"),
        (StaticLossScale, {"type": "StaticLossScale", "loss_scale": 0.0}, "0.0"),
        (StaticLossScale, [("type", "StaticLossScale")], "needs a dict"),
    ],
)
def test_from_state_dict_rejects_bad_dicts(cls, d, match):
    with pytest.raises(ValueError, match=match):
        cls.from_state_dict(d)


def test_dynamic_from_state_dict_rejects_bad_keys_and_values():
    good = DynamicLossScale.create(period=5, hysteresis=2).state_dict()
    missing = {k: v for k, v in good.items() if k not in ("counter", "hysteresis")}
    with pytest.raises(ValueError, match=r"missing keys \['counter', 'hysteresis'\]"):
        DynamicLossScale.from_state_dict(missing)
    with pytest.raises(ValueError, match=r"unknown keys \['min_loss_scale'\]"):
        DynamicLossScale.from_state_dict(dict(good, min_loss_scale=1.0))
    with pytest.raises(ValueError, match=r"missing keys \['min_scale'\].*unknown keys"):
        DynamicLossScale.from_state_dict(
            {("min_loss_scale" if k == "min_scale" else k): v for k, v in good.items()})
    for key, bad in (("counter", 5), ("counter", -1), ("overflows", 2), ("loss_scale", 2.0**25),
                     ("loss_scale", math.inf), ("period", 0), ("factor", 1.0)):
        with pytest.raises(ValueError, match=key if key != "loss_scale" else "loss_scale"):
            DynamicLossScale.from_state_dict(dict(good, **{key: bad}))
    with pytest.raises(ValueError, match="unknown loss-scale type 'Foo'"):
        loss_scale_from_state_dict({"type": "Foo"})


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"initial": 0.0}, r"initial.*> 0.*0\.0"),
        ({"initial": -2.0}, r"initial.*-2\.0"),
        ({"initial": math.inf}, r"initial.*inf"),
        ({"initial": math.nan}, r"initial.*nan"),
        ({"initial": 1e-50, "min_scale": 1e-50}, r"float32.*1e-50"),
        ({"initial": 0.5}, r"initial must lie in \[min_scale, max_scale\] = \[1\.0, .*0\.5"),
        ({"initial": 2.0**25}, r"initial must lie in .*33554432\.0"),
        ({"period": 0}, r"period.*0"),
        ({"period": -3}, r"period.*-3"),
        ({"period": 2.5}, r"period must be an int.*2\.5"),
        ({"period": 2000.0}, r"period must be an int.*2000\.0"),
        ({"period": True}, r"period must be an int.*True"),
        ({"period": 2**31}, r"period.*2147483648"),
        ({"factor": 1.0}, r"factor must be a finite number > 1.*1\.0"),
        ({"factor": 0.5}, r"factor.*0\.5"),
        ({"factor": math.inf}, r"factor.*inf"),
        ({"factor": math.nan}, r"factor.*nan"),
        ({"factor": "2"}, r"factor must be a real number.*'2'"),
        ({"min_scale": 0.0}, r"min_scale.*0\.0"),
        ({"min_scale": -1.0}, r"min_scale.*-1\.0"),
        ({"min_scale": math.inf}, r"min_scale.*inf"),
        ({"min_scale": math.nan}, r"min_scale.*nan"),
        ({"max_scale": math.inf}, r"max_scale.*inf"),
        ({"max_scale": 1e39}, r"max_scale.*float32.*1e\+39"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial": 4.0},
         r"min_scale must be <= max_scale.*8\.0.*4\.0"),
        ({"hysteresis": 0}, r"hysteresis.*0"),
        ({"hysteresis": 1.5}, r"hysteresis.*1\.5"),
    ],
)
def test_invalid_hyper_parameters_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale.create(**kwargs)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.0, r"0\.0"),
        (-1.0, r"-1\.0"),
        (math.inf, "inf"),
        (math.nan, "nan"),
        (1e39, r"float32.*1e\+39"),
        (True, "True"),
        ("8", "'8'"),
        (torch.tensor(0.0), r"tensor\(0\.\)"),
        (torch.tensor(-math.inf), "inf"),
        (torch.tensor([1.0, 2.0]), r"one-element.*\(2,\)"),
        (torch.tensor(True), "bool"),
    ],
)
def test_invalid_static_scale_rejected(value, match):
    with pytest.raises(ValueError, match=match):
        StaticLossScale(value)


def test_static_accepts_numbers_and_tensors():
    for v in (128.0, 128, torch.tensor(128.0), torch.tensor([128.0], dtype=torch.float64),
              torch.tensor(128)):
        ls = StaticLossScale(v)
        assert ls.loss_scale.dtype == torch.float32 and ls.loss_scale.shape == ()
        assert ls.loss_scale.item() == 128.0


def test_dynamic_constructor_validates_fields():
    ls = DynamicLossScale(1024.0, counter=2, overflows=1, period=3, hysteresis=2)
    assert (ls.loss_scale.item(), ls.counter.item(), ls.overflows.item()) == (1024.0, 2, 1)
    assert ls.counter.dtype == I32 and ls.overflows.dtype == I32
    with pytest.raises(ValueError, match=r"counter.*\[0, 2\].*3"):
        DynamicLossScale(1024.0, counter=3, period=3)
    with pytest.raises(ValueError, match=r"overflows.*\[0, 0\].*1"):
        DynamicLossScale(1024.0, overflows=torch.tensor(1))
    with pytest.raises(ValueError, match="loss_scale must lie"):
        DynamicLossScale(torch.tensor(0.5))
    with pytest.raises(ValueError, match="integer tensor"):
        DynamicLossScale(1024.0, counter=torch.tensor(1.0))


# --------------------------------------------------------------------------------------
# scale / unscale
# --------------------------------------------------------------------------------------

SCALED = [StaticLossScale(3.0), DynamicLossScale.create(initial=3.0)]


@pytest.mark.parametrize("ls", SCALED, ids=["static", "dynamic"])
def test_scale_dtypes(ls):
    loss32 = torch.tensor(1.5)
    out = ls.scale(loss32)
    assert out.dtype == torch.float32 and out.item() == 4.5
    for dt in (torch.bfloat16, torch.float16):
        x = torch.tensor(1.5, dtype=dt)
        y = ls.scale(x)
        assert y.dtype == torch.float32 and y.item() == 4.5
    big = torch.tensor(30000.0, dtype=torch.float16)
    assert torch.isfinite(StaticLossScale(2.0**16).scale(big))  # would be inf in fp16
    x64 = torch.tensor(0.1, dtype=torch.float64)
    assert ls.scale(x64).dtype == torch.float64 and ls.scale(x64).item() == 0.1 * 3.0
    tree = {"a": torch.tensor([1.0, 2.0]), "n": torch.tensor([1, 2]), "s": "text",
            "none": None, "k": 7}
    out = ls.scale(tree)
    assert torch.equal(out["a"], torch.tensor([3.0, 6.0]))
    assert out["n"] is tree["n"] and out["s"] == "text" and out["none"] is None
    assert out["k"] == 7


def test_scale_is_differentiable():
    ls = DynamicLossScale.create(initial=8.0)
    g = torch.func.grad(lambda x: ls.scale(x.to(torch.bfloat16).sum()))(torch.ones(3))
    assert torch.equal(g, torch.full((3,), 8.0))


@pytest.mark.parametrize("ls", SCALED, ids=["static", "dynamic"])
def test_unscale_uses_float32_reciprocal_and_keeps_dtypes(ls):
    x32 = torch.arange(1.0, 2000.0)
    inv = torch.reciprocal(torch.tensor(3.0))
    x16 = (torch.randn(500) * 100).half()
    xb = (torch.randn(500) * 100).bfloat16()
    x64 = torch.randn(5, dtype=torch.float64)
    n = torch.arange(4)
    tree = {"f32": x32, "f16": x16, "bf16": xb, "f64": x64, "int": n, "none": None}
    copies = {k: v.clone() for k, v in tree.items() if v is not None}
    out = ls.unscale(tree)
    assert torch.equal(out["f32"], x32 * inv)
    assert not torch.equal(x32 * inv, x32 / 3)  # the test can tell the two apart
    assert out["f16"].dtype == torch.float16
    assert torch.equal(out["f16"], (x16.float() * inv).half())
    assert out["bf16"].dtype == torch.bfloat16
    assert torch.equal(out["bf16"], (xb.float() * inv).bfloat16())
    assert out["f64"].dtype == torch.float64 and torch.equal(out["f64"], x64 * inv.double())
    assert out["int"] is n and out["none"] is None
    for k, v in copies.items():
        assert torch.equal(tree[k], v)  # inputs untouched
    no_float = {"n": n}
    assert ls.unscale(no_float)["n"] is n


def test_unscale_tiny_reciprocal_does_not_flush_fp16():
    ls = StaticLossScale(2.0**25)  # 1/2**25 is 0 in fp16
    g = torch.tensor([2.0**25, 2.0**26], dtype=torch.float32).half().float()
    g16 = (g / 64).half()  # representable fp16 values
    out = ls.unscale([g16])[0]
    assert out.dtype == torch.float16
    assert torch.equal(out, (g16.float() * 2.0**-25).half())
    assert (out != 0).all()


def test_scale_unscale_round_trip():
    ls = DynamicLossScale.create()
    g = {"w": torch.randn(10), "b": torch.randn(3, dtype=torch.float64)}
    back = ls.unscale(ls.scale(g))
    assert torch.equal(back["w"], g["w"]) and torch.equal(back["b"], g["b"])


def test_noop_returns_same_object():
    ls = NoOpLossScale()
    tree = {"w": torch.ones(2, dtype=torch.bfloat16)}
    assert ls.scale(tree) is tree and ls.unscale(tree) is tree
    loss = torch.tensor(2.0, dtype=torch.float16)
    assert ls.scale(loss) is loss


def test_to_device_keeps_metadata():
    ls = floor_record()
    moved = ls.to("cpu")
    same_record(moved, ls)
    assert StaticLossScale(2.0).to(torch.device("cpu")).loss_scale.device.type == "cpu"
    noop = NoOpLossScale()
    assert noop.to("cpu") is noop
    assert DynamicLossScale.create(device="cpu").loss_scale.device.type == "cpu"


# --------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# --------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_parity_no_sync_and_unscale_in_float32():
    dev = torch.device("cuda")
    rng = random.Random(7)
    bits = [rng.random() < 0.6 for _ in range(200)]
    fs = [torch.tensor(b, device=dev) for b in bits]
    ls = wide(factor=3.0, period=2, device=dev)
    scale = torch.tensor([2.0**16], device=dev)
    tracker = torch.zeros(1, dtype=I32, device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for f in fs:
            ls = ls.adjust(f)
            found_inf = (~f).float().reshape(1)
            torch._amp_update_scale_(scale, tracker, found_inf, 3.0, 1.0 / 3.0, 2)
            ls.unscale({"g": torch.ones(4, device=dev, dtype=torch.bfloat16)})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ls.loss_scale.item() == scale.item() and ls.counter.item() == tracker.item()
    st_ = StaticLossScale(3.0, device=dev)
    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randn(10000, device=dev) * 100).to(dt)
        inv = torch.reciprocal(st_.loss_scale)
        assert torch.equal(st_.unscale([x])[0], (x.float() * inv).to(dt))
