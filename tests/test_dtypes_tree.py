"""dtype names, casts over trees, the finite check and the branch-free select."""

from typing import NamedTuple

import optree
import pytest
import torch

import fmp


@pytest.mark.parametrize(
    ("name", "expected"),
    [("float32", torch.float32), ("F32", torch.float32), ("fp32", torch.float32),
     ("full", torch.float32), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
     ("float16", torch.float16), ("f16", torch.float16), ("fp16", torch.float16),
     ("half", torch.float16), ("float64", torch.float64), ("f64", torch.float64),
     ("fp64", torch.float64), (" bf16 ", torch.bfloat16), ("torch.float16", torch.float16),
     (torch.bfloat16, torch.bfloat16)],
)
def test_dtype_names(name, expected):
    assert fmp.dtype(name) is expected


@pytest.mark.parametrize("bad", ["bf17", "", "int8", "float", 3, None, torch.int32])
def test_dtype_rejects_with_accepted_list(bad):
    with pytest.raises(ValueError) as info:
        fmp.dtype(bad)
    msg = str(info.value)
    assert "bfloat16" in msg and "half" in msg
    if isinstance(bad, str) and bad:
        assert repr(bad) in msg


class Pair(NamedTuple):
    a: object
    b: object


def _tree():
    return {
        "w": torch.randn(3, 2),
        "h": torch.randn(2, dtype=torch.float16),
        "d": torch.randn(2, dtype=torch.float64),
        "i": torch.arange(3),
        "mask": torch.tensor([True, False]),
        "scalar": 1.5,
        "n": 3,
        "none": None,
        "name": "layer",
        "nested": [Pair(torch.ones(1), object), (torch.zeros(2),)],
    }


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_tree_touches_only_floating_tensors(target):
    tree = _tree()
    before = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)
    out = fmp.cast_tree(tree, target)
    assert out["w"].dtype == target and out["h"].dtype == target and out["d"].dtype == target
    assert out["nested"][0].a.dtype == target and out["nested"][1][0].dtype == target
    assert out["i"] is tree["i"] and out["i"].dtype == torch.int64
    assert out["mask"] is tree["mask"]
    assert out["scalar"] == 1.5 and isinstance(out["scalar"], float)
    assert out["n"] == 3 and out["none"] is None and out["name"] == "layer"
    assert out["nested"][0].b is object and isinstance(out["nested"][0], Pair)
    # inputs untouched
    for x, y in zip(optree.tree_leaves(tree), optree.tree_leaves(before), strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
    torch.testing.assert_close(out["w"].float(), tree["w"].to(target).float())


def test_cast_tree_same_dtype_is_no_copy():
    w = torch.randn(3)
    assert fmp.cast_tree({"w": w}, "f32")["w"] is w


def test_all_finite():
    assert fmp.all_finite({}).item() is True
    assert fmp.all_finite({"i": torch.tensor([1]), "x": None}).item() is True
    t = {"a": torch.randn(4, 4), "b": torch.randn(3, dtype=torch.bfloat16),
         "c": torch.randn(5, dtype=torch.float16)}
    out = fmp.all_finite(t)
    assert out.dtype == torch.bool and out.dim() == 0 and out.item() is True
    for key in t:
        for bad in (float("inf"), float("-inf"), float("nan")):
            t2 = dict(t)
            t2[key] = t[key].clone()
            t2[key].view(-1)[1] = bad
            assert fmp.all_finite(t2).item() is False, (key, bad)
    # huge but finite values are finite (a 2-norm would overflow to inf here)
    assert fmp.all_finite({"big": torch.full((10,), 3e38)}).item() is True
    # ints are ignored even if extreme
    assert fmp.all_finite({"i": torch.tensor([2**62])}).item() is True


def test_select_tree():
    on_t = {"w": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16), "k": 2, "n": None}
    on_f = {"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.bfloat16), "k": 2, "n": None}
    out = fmp.select_tree(torch.tensor(True), on_t, on_f)
    assert torch.equal(out["w"], on_t["w"]) and out["b"].dtype == torch.bfloat16
    out = fmp.select_tree(torch.tensor(False), on_t, on_f)
    assert torch.equal(out["w"], on_f["w"]) and torch.equal(out["b"], on_f["b"])
    assert out["k"] == 2 and out["n"] is None


def test_select_tree_bit_identical_with_nan_on_other_side():
    old = {"w": torch.randn(100)}
    new = {"w": torch.full((100,), float("nan"))}
    out = fmp.select_tree(torch.tensor(False), new, old)
    assert torch.equal(out["w"].view(torch.int32), old["w"].view(torch.int32))


@pytest.mark.parametrize(
    ("pred", "a", "b", "needle"),
    [
        (True, {"w": torch.ones(1)}, {"w": torch.ones(1)}, "0-d bool tensor"),
        (torch.tensor([True]), {"w": torch.ones(1)}, {"w": torch.ones(1)}, "shape (1,)"),
        (torch.tensor(1), {"w": torch.ones(1)}, {"w": torch.ones(1)}, "torch.int64"),
        (torch.tensor(True), {"w": torch.ones(1)}, {"v": torch.ones(1)}, "structure"),
        (torch.tensor(True), {"w": torch.ones(1)}, {"w": 1.0}, "tensor in one tree"),
        (torch.tensor(True), {"w": 1.0}, {"w": 2.0}, "differs"),
    ],
)
def test_select_tree_errors(pred, a, b, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fmp.select_tree(pred, a, b)
