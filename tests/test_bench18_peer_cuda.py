"""The graphed torch.amp peer on a GPU: GradScaler works inside the captured graph (an
overflowing step is skipped and the scale backs off on replay, then training resumes)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_peer_skips_an_overflow_and_backs_off_inside_the_graph():
    step, info = train_step.build("gpt", "amp_graph_fp16", "cuda", True)
    assert info["graphed"] is True and info["train_steps_in_build"] == train_step.GRAPH_WARMUP
    step()
    scale0 = float(step.scaler.get_scale())
    before = [p.detach().clone() for p in step.params]
    # loss (float32, ~4.8) times 2**100 is finite, but the fp16 grads it flows into are not
    step.scaler._scale.fill_(2.0**100)
    step()
    torch.cuda.synchronize()
    assert float(step.scaler.get_scale()) == 2.0**99  # update() ran in the graph: backoff
    assert all(torch.equal(a, p) for a, p in zip(before, step.params, strict=True))  # skipped
    step.scaler._scale.fill_(scale0)
    loss = float(step())
    assert float(step.scaler.get_scale()) == scale0
    assert any(not torch.equal(a, p) for a, p in zip(before, step.params, strict=True))
    assert math.isfinite(loss)
