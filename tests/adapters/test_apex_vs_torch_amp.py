"""Differential test: adapter O1 + dynamic scaling vs torch.autocast + torch.amp.GradScaler."""

from __future__ import annotations

import pytest
import torch

from adapters.apex.amp import Amp


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_same_scale_trajectory_and_params(opt_cls):
    window = 3
    inject = {2, 3, 9, 10, 11, 17}
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(24)]

    m_amp = model()
    o_amp = opt_cls(m_amp.parameters(), lr=1e-2)
    amp = Amp(scale_window=window)
    m_amp, o_amp = amp.initialize(m_amp, o_amp, opt_level="O1", verbosity=0)

    m_ref = model()
    o_ref = opt_cls(m_ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=window)

    scales_amp, scales_ref, skipped_amp = [], [], []
    for i, (x, y) in enumerate(data):
        o_amp.zero_grad()
        with amp.autocast():
            loss = torch.nn.functional.cross_entropy(m_amp(x), y)
        with amp.scale_loss(loss, o_amp) as scaled:
            scaled.backward()
            if i in inject:
                m_amp[2].weight.grad[1, 1] = float("inf")
        o_amp.step()
        skipped_amp.append(amp.last_step_skipped())
        scales_amp.append(amp.loss_scale())

        o_ref.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m_ref(x).float(), y)
        scaler.scale(loss).backward()
        if i in inject:
            m_ref[2].weight.grad[1, 1] = float("inf")
        scaler.step(o_ref)
        scaler.update()
        scales_ref.append(scaler.get_scale())

        for p, q in zip(m_amp.parameters(), m_ref.parameters(), strict=True):
            assert torch.equal(p, q), i
    assert scales_amp == scales_ref
    assert skipped_amp == [i in inject for i in range(len(data))]
    assert len(set(scales_amp)) >= 4  # it both grew and backed off
