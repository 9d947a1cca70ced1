"""fmp.distributed and train_step(process_group=...) on 2 CPU processes (gloo).

One launch of ``worker_main.py`` (the ``ranks`` fixture of conftest.py) runs every
scenario; the tests below check its results. Ranks are plain subprocesses with a hard
time limit (:mod:`dist_launch`), so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import assert_trees_bit_equal
from worker_ddp import INJECT, STEPS

import fmp
import fmp.distributed as fd


def test_data_parallel_equals_one_process_on_the_whole_batch(result):
    r0, r1 = result("equal_to_single")
    assert_trees_bit_equal(r0["dp"]["params"], r1["dp"]["params"])
    for a, b in zip(optree.tree_leaves(r0["dp"]["params"]),
                    optree.tree_leaves(r0["single"]["params"]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the run trained, and the reported loss is each rank's own
    first, last = r0["dp"]["trace"][0]["loss"], r0["dp"]["trace"][-1]["loss"]
    assert last < 0.5 * first
    assert not torch.equal(r0["dp"]["trace"][0]["loss"], r1["dp"]["trace"][0]["loss"])


def test_inf_on_one_rank_makes_every_rank_skip(result):
    r0, r1 = result("inf_on_one_rank")
    for r in (r0, r1):
        assert [bool(t["skipped"]) for t in r["trace"]] == [i in INJECT for i in range(STEPS)]
        assert int(r["skipped_total"]) == len(INJECT)
        for i in INJECT:  # a skipped step leaves the params bit-identical
            assert_trees_bit_equal(r["trace"][i]["params"], r["trace"][i - 1]["params"])
    for t0, t1 in zip(r0["trace"], r1["trace"], strict=True):
        assert_trees_bit_equal(t0["params"], t1["params"])
        assert torch.equal(t0["loss_scale"], t1["loss_scale"])
    # the scale backed off on both ranks (period 2: 1024 -> 2048 -> 1024 -> ...)
    assert [float(t["loss_scale"]) for t in r0["trace"]] == [1024, 2048, 1024, 1024, 512, 512]


def test_all_finite_gives_every_rank_the_same_verdict(result):
    r0, r1 = result("all_finite_verdicts")
    assert r0 == r1
    want = {"all_ok": True, "inf_on_1": False, "nan_on_0": False, "ragged": True,
            "no_float_leaves_on_1": True}
    assert {k: v[2] for k, v in r0.items()} == want
    assert all(v[:2] == (torch.bool, ()) for v in r0.values())


def test_all_reduce_grads_values_dtypes_purity(result):
    r0, r1 = result("all_reduce_results")
    for r in (r0, r1):
        for a, b in zip(optree.tree_leaves(r["tree"]), optree.tree_leaves(r["before"]),
                        strict=True):  # inputs untouched
            assert torch.equal(a, b) and a.stride() == b.stride()
        for key, want in (("mean", 1.5), ("sum", 3.0), ("small", 1.5), ("f32", 1.5)):
            out = r[key]
            assert optree.tree_structure(out) == optree.tree_structure(r["tree"])
            for a, b in zip(optree.tree_leaves(out), optree.tree_leaves(r["tree"]),
                            strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                if a.is_floating_point():
                    assert torch.equal(a, torch.full_like(a, want)), key
                else:
                    assert a is b  # integer leaves pass through
    assert_trees_bit_equal(r0["mean"]["w"], r1["mean"]["w"])
    assert torch.equal(r0["mean"]["h"], r1["mean"]["h"])


def test_all_reduce_grads_is_bucketed(result):
    r = result("all_reduce_results")[0]
    n32 = 40 * 15 + 24
    # one collective per (device, dtype) at the default 25 MB cap: 41 float32 leaves, 1 bf16
    assert sorted(r["mean_calls"], key=str) == sorted([(torch.bfloat16, 7),
                                                       (torch.float32, n32)], key=str)
    # an 800-byte cap: buckets of at most 200 float32 elements, none empty
    sizes = [n for d, n in r["small_calls"] if d == torch.float32]
    assert sum(sizes) == n32 and all(n <= 200 for n in sizes) and len(sizes) == 4
    # reduce_dtype=f32: the bf16 leaf is reduced in float32 and cast back
    assert {d for d, _ in r["f32_calls"]} == {torch.float32}


def test_mismatched_trees_raise_on_every_rank_not_hang(result):
    r0, r1 = result("mismatched_trees")
    for r in (r0, r1):
        assert "leaf 'b' is float32[4] on rank 0 but float32[5] on rank 1" in r["shape"]
        assert "rank 0 has 1 leaves, rank 1 has 2" in r["extra_leaf"]
        assert "'c'" in r["extra_leaf"]
        assert "leaf 'a' is float32[3] on rank 0 but float16[3] on rank 1" in r["dtype"]
        assert torch.equal(r["after"], torch.ones(2))
        assert r["gathers"] == 1


def test_train_step_rejects_a_misspelt_group(result):
    for msg in result("train_step_rejects_bad_group"):
        assert "'defualt'" in msg


@pytest.mark.slow
def test_compiled_data_parallel_step_equals_eager(slow_result):
    for r in slow_result("compiled_step_equals_eager"):
        for bad, runs in r.items():
            s_e, m_e = runs["eager"]
            for how in ("compiled", "fmp.compile"):
                s_c, m_c = runs[how]
                assert_trees_bit_equal(s_c.params, s_e.params)
                assert bool(m_c["skipped"]) == bool(m_e["skipped"]) == bad
                assert torch.equal(m_c["loss_scale"], m_e["loss_scale"])


# ---- in this (single, uninitialised) process ----------------------------------------

def test_uninitialised_process_group_is_a_clear_error():
    assert not torch.distributed.is_initialized()
    opt = fmp.optim.sgd(0.1)
    with pytest.raises(RuntimeError, match=r"not initialised.*init_process_group"):
        fmp.train_step(lambda p, x: (p["w"] * x).sum(), opt, process_group="default")
    with pytest.raises(RuntimeError, match="not initialised"):
        fd.all_reduce_grads({"w": torch.ones(2)})
    with pytest.raises(RuntimeError, match="not initialised"):
        fd.all_finite({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="op must be 'mean' or 'sum'"):
        fd.all_reduce_grads({"w": torch.ones(2)}, op="max")
    with pytest.raises(ValueError, match="bucket_mb"):
        fd.all_reduce_grads({"w": torch.ones(2)}, bucket_mb=0)


@pytest.mark.parametrize("spec,want", [
    ("bf16-mixed", (torch.bfloat16, torch.float32, torch.float32)),
    ("fp16-mixed", (torch.float16, torch.float32, torch.float32)),
    ("bf16-true", (torch.bfloat16, torch.float32, torch.bfloat16)),
    ("fp32", (torch.float32, torch.float32, torch.float32)),
    ("p=f32,c=bf16,o=bf16", (torch.bfloat16, torch.float32, torch.bfloat16)),
])
def test_fsdp_mixed_precision_fields(spec, want):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = fd.fsdp_mixed_precision(spec)
    assert isinstance(mp, MixedPrecisionPolicy)
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == want
    assert mp.cast_forward_inputs is True
    assert fd.fsdp_mixed_precision(fmp.get_policy(spec), reduce_dtype=None).reduce_dtype is None
    inner = fd.fsdp_mixed_precision(spec, root=False)
    assert (inner.param_dtype, inner.reduce_dtype, inner.output_dtype) == (*want[:2], None)
