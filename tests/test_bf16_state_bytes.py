"""Bytes per param with grads counted: bf16 without masters (10) against float32 masters (16)."""

from __future__ import annotations

import torch

import fmp


def test_bytes_per_param_with_grads_bf16_kahan_is_10_against_16_for_fp32_masters():
    bf16 = torch.bfloat16
    p16 = {"w": torch.zeros(10_000, dtype=bf16), "b": torch.zeros(100, dtype=bf16)}
    p32 = {"w": torch.zeros(10_000), "b": torch.zeros(100)}
    bpp = fmp.optim.state_bytes_per_param
    kahan = fmp.optim.adamw(state_dtype="bf16", bf16_update="kahan")
    masters = fmp.optim.adamw()
    # 2 param + 2 compensation + 2 mu + 2 nu + 2 grad (+ the int32 count, 4 bytes in all)
    assert round(bpp(p16, kahan.init(p16), grads=True), 2) == 10.0
    # 4 master + 4 mu + 4 nu + 4 grad
    assert round(bpp(p32, masters.init(p32), grads=True), 2) == 16.0
    # without grads the default is unchanged: 8 against 12
    assert round(bpp(p16, kahan.init(p16)), 2) == 8.0
    assert round(bpp(p32, masters.init(p32)), 2) == 12.0
