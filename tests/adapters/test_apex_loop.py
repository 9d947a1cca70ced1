"""The issue's seed loop on CPU (``.cuda()`` swapped for ``.to(device)``), at every opt level."""

from __future__ import annotations

import pytest
import torch
from resnet_tiny import TinyResNet, loader

from adapters import apex  # was: import apex


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_seed_loop_learns(level):
    torch.manual_seed(0)
    device = "cpu"
    model = TinyResNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    amp = apex.amp.Amp() if level != "O1" else apex.amp.default_amp()
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    losses = []
    data = loader(12, batch=16, size=8)
    for _epoch in range(6):
        for inputs, labels in data:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            with amp.autocast():
                outputs = model(inputs)
            loss = criterion(outputs, labels)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses.append(loss.item())
            assert loss.dtype == torch.float32
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.7 * first, (level, first, last)


def test_add_param_group_after_initialize_behaves_as_plain_torch():
    for level in ("O0", "O1", "O2", "O3"):
        for accumulate in (False, True):
            torch.manual_seed(0)
            m0, m1 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
            r0, r1 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
            r0.load_state_dict(m0.state_dict())
            r1.load_state_dict(m1.state_dict())
            opt = torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125)
            ropt = torch.optim.SGD(r0.parameters(), lr=0.25, momentum=0.125)
            amp = apex.amp.Amp()
            (m0, m1), opt = amp.initialize([m0, m1], opt, opt_level=level, verbosity=0,
                                           loss_scale=4.0)
            low = m0.weight.dtype
            if low != torch.float32:  # the reference runs in the model's dtype
                r0.to(low)
                r1.to(low)
            x = torch.linspace(-1, 1, 6).reshape(2, 3)
            for i in range(4):
                # m1 gets grads before it joins the optimizer; they stay scaled (as in
                # Apex: only the optimizers' params are unscaled), so drop them
                m1.zero_grad()
                r1.zero_grad()
                if i == 2:
                    opt.add_param_group({"params": m1.parameters(), "lr": 0.5})
                    ropt.add_param_group({"params": r1.parameters(), "lr": 0.5})
                for _ in range(2 if accumulate else 1):
                    loss = m1(m0(x.to(low))).float().sum()
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                    r1(r0(x.to(low))).float().sum().backward()
                opt.step()
                ropt.step()
                opt.zero_grad()
                ropt.zero_grad()
                for m, r in ((m0, r0), (m1, r1)):
                    for p, q in zip(m.parameters(), r.parameters(), strict=True):
                        torch.testing.assert_close(p.float(), q.float(), rtol=2e-3,
                                                   atol=2e-3)
            if level == "O2":
                masters = list(amp.master_params(opt))
                assert len(masters) == 4 and all(p.dtype == torch.float32 for p in masters)
                assert torch.equal(m1.weight, masters[2].half())
