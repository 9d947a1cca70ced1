"""fmp.float8's recipe, records and scaling arithmetic (CPU): validation errors, Transformer
Engine's delayed-scaling update against a hand computation, saturating casts, and the
docstring examples of fmp/float8."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch

import fmp
from fmp.float8 import Float8LinearScales, Recipe
from fmp.float8._cast import amax, scale_from, to_float8

E4M3, E5M2 = 448.0, 57344.0


@pytest.mark.parametrize("kwargs, message", [
    ({"scaling": "static"}, "Recipe.scaling must be one of ('dynamic', 'delayed'), got 'static'"),
    ({"history": 0}, "Recipe.history must be an int >= 1, got 0"),
    ({"history": 2.0}, "Recipe.history must be an int >= 1, got 2.0"),
    ({"history": True}, "Recipe.history must be an int >= 1, got True"),
    ({"margin": -1}, "Recipe.margin must be a finite number >= 0, got -1"),
    ({"margin": float("inf")}, "Recipe.margin must be a finite number >= 0, got inf"),
    ({"margin": "1"}, "Recipe.margin must be a finite number >= 0, got '1'"),
    ({"fwd_format": "e5m2"}, "Recipe.fwd_format must be 'e4m3'"),
    ({"bwd_format": "e3m4"}, "Recipe.bwd_format must be one of ('e4m3', 'e5m2'), got 'e3m4'"),
])
def test_bad_recipes_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        Recipe(**kwargs)
    assert str(e.value).startswith(message)


def test_convert_rejects_a_bad_recipe_and_a_bad_model():
    with pytest.raises(ValueError, match=r"Recipe.scaling must be one of"):
        fmp.float8.convert(torch.nn.Linear(16, 16), "sometimes")
    with pytest.raises(TypeError, match=r"fmp.float8.Recipe or one of"):
        fmp.float8.convert(torch.nn.Linear(16, 16), 3)
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module"):
        fmp.float8.convert("model")
    with pytest.raises(ValueError, match="no Float8Linear layer"):
        fmp.float8.init(torch.nn.Linear(16, 16))


def test_create_is_zero_history_unit_scales():
    r = Float8LinearScales.create(Recipe("delayed", history=5, margin=2))
    assert r.amax_history.dtype == r.scale.dtype == torch.float32
    assert r.amax_history.shape == (3, 5) and not r.amax_history.any()
    assert r.scale.tolist() == [1.0, 1.0, 1.0]
    assert (r.scaling, r.margin, r.history, r.delayed) == ("delayed", 2, 5, True)


def _hand_update(hist, scale, amaxes, margin, maxes=(E4M3, E4M3, E5M2)):
    """TE's recipe in Python floats: newest amax first, the oldest dropped; a row keeps its
    scale where the window's max is 0 or not finite."""
    hist = [[a, *row[:-1]] for a, row in zip(amaxes, hist, strict=True)]
    out = []
    for row, s, top in zip(hist, scale, maxes, strict=True):
        m = max(row) if not any(math.isnan(v) for v in row) else math.nan
        if m > 0 and math.isfinite(m):
            # float32 division of float32 values: rounding the double quotient is exact
            out.append(float(torch.tensor(top / m, dtype=torch.float32)) / 2.0 ** margin)
        else:
            out.append(s)
    return hist, out


def test_update_rolls_the_history_and_follows_the_hand_formula():
    r = Float8LinearScales.create(Recipe("delayed", history=3, margin=1))
    hist = [[0.0] * 3 for _ in range(3)]
    scale = [1.0, 1.0, 1.0]
    steps = [[2.0, 0.5, 3.0], [0.25, 0.0, 7.0], [1.5, 0.0, 1.0], [0.125, 0.0, 0.5],
             [0.1, 0.0, float("inf")], [3.0, 0.2, float("nan")]]
    for a in steps:
        r = r.update(torch.tensor(a))
        hist, scale = _hand_update(hist, scale, a, 1)
        torch.testing.assert_close(r.amax_history, torch.tensor(hist), rtol=0, atol=0,
                                   equal_nan=True)
        assert r.scale.tolist() == scale
    # the window of 3 forgot the 2.0 of the first step: the input scale is 448/1.5/2
    assert scale[0] == float(torch.tensor(E4M3 / 3.0, dtype=torch.float32)) / 2


def test_zero_and_non_finite_amaxes_keep_the_scale():
    r = Float8LinearScales.create(Recipe("delayed", history=1))
    r = r.update(torch.tensor([4.0, 8.0, 16.0]))
    assert r.scale.tolist() == [112.0, 56.0, 3584.0]
    for bad in (0.0, float("inf"), float("nan")):
        assert r.update(torch.tensor([bad] * 3)).scale.tolist() == [112.0, 56.0, 3584.0]
    tiny = r.update(torch.tensor([1e-45, 1e-45, 1e-45]))  # 448 / 1e-45 overflows float32
    assert tiny.scale.tolist() == [112.0, 56.0, 3584.0]


def test_dynamic_records_do_not_change():
    r = Float8LinearScales.create(Recipe("dynamic"))
    assert r.update(torch.tensor([1.0, 2.0, 3.0])) is r


def test_update_is_a_pure_function_of_the_record():
    r = Float8LinearScales.create(Recipe("delayed", history=2))
    before = r.amax_history.clone(), r.scale.clone()
    r2 = r.update(torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(r.amax_history, before[0]) and torch.equal(r.scale, before[1])
    assert r2 is not r and r2.scaling == "delayed"


def test_scale_from_and_amax():
    bf = torch.tensor([[1.0, -5.0], [2.0, 0.0]], dtype=torch.bfloat16)
    assert amax(bf).dtype == torch.float32
    assert float(amax(torch.tensor([1.0, -5.0]))) == 5.0
    got = scale_from(torch.tensor([1.0, 0.0, -1.0]), 448.0, 0, torch.tensor([7.0, 7.0, 7.0]))
    assert got.tolist() == [448.0, 7.0, 7.0]


@pytest.mark.parametrize("fmt, top", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_casts_saturate_and_scale(fmt, top):
    x = torch.tensor([top * 10, -top * 10, 1.0, -0.5, 0.0, float("nan")])
    q = to_float8(x, torch.tensor(1.0), fmt)
    assert q.dtype == fmp.float8.FORMATS[fmt]
    got = q.float()
    assert got[:5].tolist() == [top, -top, 1.0, -0.5, 0.0] and math.isnan(got[5])
    # the scale multiplies before rounding: 3 * 4 = 12 is exact in both formats
    assert to_float8(torch.tensor([3.0]), torch.tensor(4.0), fmt).float().tolist() == [12.0]


def test_record_state_dict_round_trip_and_checks():
    r = Float8LinearScales.create(Recipe("delayed", history=4, margin=1)).update(
        torch.tensor([1.0, 2.0, 3.0]))
    back = Float8LinearScales.from_state_dict(r.state_dict())
    assert back.amax_history is r.amax_history and back.scale is r.scale
    assert (back.scaling, back.margin, back.fwd_format, back.bwd_format) == \
        ("delayed", 1, "e4m3", "e5m2")
    bad = {**r.state_dict(), "scale": torch.ones(2)}
    with pytest.raises(ValueError, match=r"scale float32 \[3\], got .*torch.float32 \[3, 4\] "
                                         r"and torch.float32 \[2\]"):
        Float8LinearScales.from_state_dict(bad)
    with pytest.raises(ValueError, match="missing"):
        Float8LinearScales.from_state_dict({"scale": r.scale})


def test_records_are_pytrees_with_static_recipe_fields():
    import optree

    r = Float8LinearScales.create(Recipe("delayed", history=2))
    leaves, spec = optree.tree_flatten(r)
    assert leaves == [r.amax_history, r.scale]
    back = optree.tree_unflatten(spec, [x + 1 for x in leaves])
    assert back.scaling == "delayed" and back.scale.tolist() == [2.0, 2.0, 2.0]
    tleaves, _ = torch.utils._pytree.tree_flatten(r)
    assert len(tleaves) == 2


@pytest.mark.parametrize("name", ["fmp.float8._recipe", "fmp.float8._cast",
                                  "fmp.float8._scales", "fmp.float8._linear",
                                  "fmp.float8._convert"])
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    globs = {"fmp": fmp, "torch": torch, **vars(mod)}
    # the module's own objects, and its classes whose __module__ names their public home
    objs = [mod] + [v for v in vars(mod).values() if isinstance(v, type)
                    and v.__module__ == "fmp.float8" and v.__doc__]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    finder = doctest.DocTestFinder()
    for obj in objs:
        for t in finder.find(obj, name, globs=globs):
            runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.attempted > 0 and res.failed == 0
