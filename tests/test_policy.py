"""Policy grammar, presets, str round trip, casts and per-module policies."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fmp
from fmp.dtypes import DTYPE_NAMES

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fp32", (F32, F32, F32)),
        ("bf16-mixed", (F32, BF16, F32)),
        ("fp16-mixed", (F32, F16, F32)),
        ("bf16-true", (BF16, BF16, BF16)),
        ("fp16-true", (F16, F16, F16)),
        ("O0", (F32, F32, F32)),
        ("O1", (F32, F16, F32)),
        ("O2", (F32, F16, F32)),
        ("O3", (F16, F16, F16)),
        ("o3", (F16, F16, F16)),
        ("BF16-Mixed", (F32, BF16, F32)),
        ("half", (F16, F16, F16)),
        ("f64", (F64, F64, F64)),
        ("c=bf16", (F32, BF16, BF16)),
        ("compute=f16", (F32, F16, F16)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("params=f32,compute=bf16,output=f32", (F32, BF16, F32)),
        ("p=f32, c=half, o=full", (F32, F16, F32)),
        ("o=f16", (F32, F32, F16)),
        (" C = BF16 , O = F32 ", (F32, BF16, F32)),
    ],
)
def test_grammar(spec, expected):
    p = fmp.get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


@pytest.mark.parametrize("key", ["p", "params", "c", "compute", "o", "output"])
@pytest.mark.parametrize("name", list(DTYPE_NAMES))
def test_every_key_and_name(key, name):
    p = fmp.get_policy(f"{key}={name}")
    field = {"p": "param_dtype", "c": "compute_dtype", "o": "output_dtype"}[key[0]]
    assert getattr(p, field) is DTYPE_NAMES[name]


@pytest.mark.parametrize(
    ("spec", "quoted", "lists"),
    [
        ("c=bf16=x", "'c=bf16=x'", "key=dtype"),
        ("x=bf16", "'x'", "compute"),
        ("c=bf17", "'bf17'", "bfloat16"),
        ("p=f32,,c=bf16", "'p=f32,,c=bf16'", "bf16-mixed"),
        ("c=bf16,", "'c=bf16,'", "bf16-mixed"),
        (",c=bf16", "',c=bf16'", "bf16-mixed"),
        ("", "''", "bf16-mixed"),
        ("   ", "'   '", "bf16-mixed"),
        ("bf17", "'bf17'", "bf16-mixed"),
        ("mixed", "'mixed'", "fp16-mixed"),
        ("c=", "''", "bfloat16"),
        ("=bf16", "''", "compute"),
        ("bf16,c=f16", "'bf16'", "key=dtype"),
        ("c=f16,compute=bf16", "'compute=bf16'", "twice"),
        ("O6", "'O6'", "O5"),
    ],
)
def test_bad_specs(spec, quoted, lists):
    with pytest.raises(ValueError) as info:
        fmp.get_policy(spec)
    msg = str(info.value)
    assert quoted in msg, msg
    assert lists in msg, msg


@pytest.mark.parametrize("bad", [None, 3, torch.float16, ["bf16"]])
def test_non_string_spec(bad):
    with pytest.raises(ValueError, match="str or Policy"):
        fmp.get_policy(bad)


_dt = st.sampled_from([F32, BF16, F16, F64])


@given(_dt, _dt, _dt)
def test_str_round_trip(p, c, o):
    pol = fmp.Policy(p, c, o)
    assert fmp.get_policy(str(pol)) == pol
    assert fmp.get_policy(pol) is pol


def test_str_form():
    assert str(fmp.get_policy("bf16-mixed")) == "params=float32,compute=bfloat16,output=float32"


def test_policy_fields_accept_names_and_reject_bad():
    assert fmp.Policy("f32", "bf16", "half") == fmp.Policy(F32, BF16, F16)
    with pytest.raises(ValueError, match="'bf17'"):
        fmp.Policy("f32", "bf17", "f32")
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        fmp.get_policy("fp32").param_dtype = F16  # type: ignore[misc]


def test_casts_and_with_output_dtype():
    pol = fmp.get_policy("p=f32,c=bf16,o=f16")
    tree = {"w": torch.randn(3), "i": torch.arange(3), "s": 2.0}
    assert pol.cast_to_compute(tree)["w"].dtype == BF16
    assert pol.cast_to_output(tree)["w"].dtype == F16
    assert pol.cast_to_param(pol.cast_to_compute(tree))["w"].dtype == F32
    assert pol.cast_to_compute(tree)["i"] is tree["i"]
    assert tree["w"].dtype == F32
    assert pol.with_output_dtype("f32").output_dtype == F32
    assert pol.with_output_dtype("f32").compute_dtype == BF16
    assert pol.is_mixed and not fmp.get_policy("bf16-true").is_mixed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.bn = torch.nn.BatchNorm2d(2)
        self.enc = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(4, 2)
        self.tied = self.head  # a second name for the same module


def test_module_policies_by_class_and_pattern():
    net = Net()
    pol = fmp.module_policies(
        net, "bf16-mixed",
        {torch.nn.LayerNorm: "fp32", torch.nn.BatchNorm2d: "fp32", "head": "fp16-mixed"},
    )
    assert list(pol) == [n for n, _ in net.named_parameters()]
    assert pol["bn.weight"].compute_dtype == F32 and pol["bn.bias"].compute_dtype == F32
    assert pol["enc.0.norm.weight"].compute_dtype == F32
    assert pol["enc.1.norm.bias"].compute_dtype == F32
    assert pol["enc.0.lin.weight"].compute_dtype == BF16
    assert pol["conv.weight"].compute_dtype == BF16
    assert pol["head.weight"].compute_dtype == F16


def test_module_policies_first_match_wins_and_globs():
    net = Net()
    pol = fmp.module_policies(net, "fp32", {"enc.1*": "bf16-true", "enc.*": "fp16-mixed"})
    assert pol["enc.1.lin.weight"].param_dtype == BF16
    assert pol["enc.0.lin.weight"].compute_dtype == F16
    assert pol["head.weight"] == fmp.get_policy("fp32")


def test_module_policies_bad_key():
    with pytest.raises(ValueError, match="module class or an fnmatch pattern"):
        fmp.module_policies(Net(), "fp32", {3: "fp32"})


def test_cast_params():
    net = Net()
    pol = fmp.module_policies(net, "bf16-mixed", {torch.nn.BatchNorm2d: "fp32"})
    _, params, _ = fmp.functional(net)
    out = fmp.cast_params(params, pol, "compute")
    assert out["bn.weight"].dtype == F32 and out["conv.weight"].dtype == BF16
    assert params["conv.weight"].dtype == F32
    assert fmp.cast_params(params, pol, "param")["conv.weight"].dtype == F32
    with pytest.raises(ValueError, match="which='grad'"):
        fmp.cast_params(params, pol, "grad")
    with pytest.raises(ValueError, match="extra"):
        fmp.cast_params({**params, "extra": torch.ones(1)}, pol, "compute")
