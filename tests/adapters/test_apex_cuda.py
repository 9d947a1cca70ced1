"""The issue's seed loop on CUDA, with a torchvision-free ResNet-style model (skips on CPU)."""

from __future__ import annotations

import pytest
import torch
from resnet_tiny import TinyResNet, loader

from adapters import apex  # was: import apex

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_seed_loop_on_cuda(level):
    torch.manual_seed(0)
    model = TinyResNet().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    amp = apex.amp.Amp()
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    losses = []
    for _epoch in range(3):
        for inputs, labels in loader(12, batch=32, size=16):
            inputs, labels = inputs.cuda(), labels.cuda()
            optimizer.zero_grad()
            with amp.autocast():
                outputs = model(inputs)
            loss = criterion(outputs, labels)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()  # skipped after an overflow
            losses.append(loss.item())
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10]), losses
    assert all(p.is_cuda for p in amp.master_params(optimizer))


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("opt", ["Adam", "AdamW", "SGD"])
def test_fused_optimizer_step_has_no_host_sync(level, opt):
    torch.manual_seed(0)
    model = TinyResNet().cuda()
    kw = {"momentum": 0.9} if opt == "SGD" else {}
    optimizer = getattr(torch.optim, opt)(model.parameters(), lr=1e-3, fused=True, **kw)
    amp = apex.amp.Amp()
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                                      loss_scale="dynamic")
    data = [(x.cuda(), y.cuda()) for x, y in loader(6, batch=8, size=16)]
    snapshots, skipped = [], []
    for i, (inputs, labels) in enumerate(data):
        optimizer.zero_grad()
        with amp.autocast():
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        if i >= 1:  # the first step initialises fused SGD's momentum (a synced check)
            torch.cuda.set_sync_debug_mode("error")
        try:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if i == 3:
                    model.fc.weight.grad[0, 0].fill_(float("inf"))  # no host sync
            before = [p.detach().clone() for p in amp.master_params(optimizer)]
            optimizer.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        snapshots.append((before, [p.detach().clone() for p in amp.master_params(optimizer)]))
        skipped.append(amp.last_step_skipped())  # reads the device flag: outside the check
    assert skipped == [False, False, False, True, False, False]
    before, after = snapshots[3]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    before, after = snapshots[4]
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert amp.loss_scale() == 2.0**15


def test_bf16_grads_unscale_on_cuda():
    from fmp.loss_scale._inplace import unscale_and_check_

    g = [torch.full((4,), 8.0, device="cuda", dtype=torch.bfloat16),
         torch.full((4,), 8.0, device="cuda", dtype=torch.float16)]
    found = torch.zeros((), device="cuda")
    unscale_and_check_(g, torch.tensor(0.25, device="cuda"), found)
    assert found.item() == 0.0 and all((t == 2.0).all() for t in g)
    g[0][1] = float("inf")
    unscale_and_check_(g, torch.tensor(1.0, device="cuda"), found)
    assert found.item() == 1.0
