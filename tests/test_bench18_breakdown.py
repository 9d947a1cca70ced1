"""benchmarks/breakdown.py: kernel names into buckets, busy/idle arithmetic, CPU smoke."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import breakdown

NAMES = {
    "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64": "matmuls",
    "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "matmuls",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>(Params)": "matmuls",
    "aten::addmm": "matmuls",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
    "fmha_cutlassB_f16_aligned_64x64_k64_sm80": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "triton_red_fused__log_softmax_backward_data_nll_loss_backward_0": "cross_entropy",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "elementwise_norms",
    "aten::_log_softmax": "cross_entropy",
    "void at::native::(anonymous)::fused_adam_kernel<float>": "optimizer_update",
    "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>":
        "optimizer_update",
    "triton_poi_fused__to_copy_add_addcmul_lerp_mul_sqrt_div_3": "optimizer_update",
    "void at::native::_amp_non_finite_check_and_unscale_cuda_kernel": "optimizer_update",
    "triton_poi_fused__to_copy_0": "casts",
    "triton_poi_fused__to_copy_clone_12": "casts",
    "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "casts",
    "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor<c10::Half>>":
        "casts",
    "aten::_to_copy": "casts",
    "aten::copy_": "casts",
    "triton_per_fused_native_layer_norm_native_layer_norm_backward_7": "elementwise_norms",
    "triton_poi_fused_gelu_mul_tanh_4": "elementwise_norms",
    "void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>": "elementwise_norms",
    "aten::native_layer_norm": "elementwise_norms",
    "Memcpy DtoD (Device -> Device)": "memcpy_memset",
    "Memset (Device)": "memcpy_memset",
    "aten::empty_strided": "other",
}


@pytest.mark.parametrize("name,bucket", list(NAMES.items()))
def test_bucket_of(name, bucket):
    assert breakdown.bucket_of(name) == bucket


def test_summarize_sums_buckets_and_takes_idle_from_the_busy_union():
    us = [("sm90_gemm", 0.0, 1000.0), ("triton_poi_fused__to_copy_0", 500.0, 1500.0),  # overlap
          ("fused_adam_kernel", 3000.0, 3500.0), ("sm90_gemm", 10000.0, 11000.0)]
    s = breakdown.summarize(us, steps=2, step_ms=3.0)
    assert s["ms"]["matmuls"] == pytest.approx(1.0)  # 2 ms over 2 steps
    assert s["ms"]["casts"] == pytest.approx(0.5)
    assert s["ms"]["optimizer_update"] == pytest.approx(0.25)
    assert s["busy_ms"] == pytest.approx((1.5 + 0.5 + 1.0) / 2)
    assert s["idle_ms"] == pytest.approx(3.0 - 1.5)
    assert s["kernels_per_step"] == 2.0
    assert s["top"][0] == {"name": "sm90_gemm", "bucket": "matmuls", "ms": pytest.approx(1.0)}
    assert s["most_launched"][0] == {"name": "sm90_gemm", "per_step": 1.0,
                                     "ms": pytest.approx(1.0)}
    assert [k["per_step"] for k in s["most_launched"]] == [1.0, 0.5, 0.5]
    assert breakdown.summarize(us, 2, None)["idle_ms"] is None


def test_cpu_smoke_writes_one_json(tmp_path):
    out = tmp_path / "b.json"
    res = breakdown.main(["--tiny", "--device", "cpu", "--variants", "gpt:amp_fp16_eager",
                          "--steps", "2", "--warmup", "1", "--out", str(out)])
    r = json.loads(out.read_text())["gpt:amp_fp16_eager"]
    assert r == json.loads(json.dumps(res["gpt:amp_fp16_eager"]))
    assert r["what"] == "CPU aten ops, self time"
    assert r["ms"]["matmuls"] > 0 and r["ms"]["optimizer_update"] > 0
    assert sum(r["ms"].values()) == pytest.approx(r["busy_ms"])


def test_bad_variant_spec_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        breakdown.main(["--variants", "amp_fp16_eager", "--device", "cpu"])
    assert info.value.code == 2 and "MODEL:VARIANT" in capsys.readouterr().err
