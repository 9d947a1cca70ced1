"""Legacy loops in the style of common Apex scripts (issue 14 catalogue).

Each loop is written as the script would be, with only ``from adapters import apex`` /
``from adapters.apex import amp`` where the script imported Apex, and the module functions
(the default Amp, as scripts use it; every loop makes fresh objects, so earlier tests'
``initialize`` calls do not matter). Loops:

- a DCGAN-style GAN: two models, two optimizers, three losses (``num_losses=3``,
  ``loss_id``);
- fine-tuning a pretrained encoder with gradient accumulation and
  ``clip_grad_norm_(amp.master_params(optimizer), ...)``;
- a checkpoint resume after loading pretrained weights: ``amp.state_dict()`` + model +
  optimizer saved, restored into fresh objects, the trajectory identical.

At O0 every loop must match plain PyTorch bit for bit (the peer); at the mixed levels it
must stay close to it, and the Apex-visible effects (skips, per-loss scales) are checked.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _same(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a, b, tol):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True)) \
        < tol


# ------------------------------------------------------------------------------------
# 1. DCGAN-style: two models, two optimizers, three losses
# ------------------------------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self, nz=8, nf=16):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, nf), nn.BatchNorm1d(nf), nn.ReLU(True),
                                  nn.Linear(nf, 12), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, nf=16):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(12, nf), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(nf, 1))

    def forward(self, x):
        return self.main(x).view(-1)


def gan_script(device, opt_level, iters=4, poison_fake_at=None, use_amp=True):
    """The loop of Apex's DCGAN example: D on real (loss 0), D on fake (loss 1), G (loss 2)."""
    from adapters.apex import amp

    torch.manual_seed(0)
    netG, netD = Generator().to(device), Discriminator().to(device)
    criterion = nn.BCEWithLogitsLoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    if use_amp:
        [netD, netG], [optimizerD, optimizerG] = amp.initialize(
            [netD, netG], [optimizerD, optimizerG], opt_level=opt_level, num_losses=3,
            verbosity=0)

    def backward(loss, optimizer, loss_id, poison=False):
        if not use_amp:
            loss.backward()
            return
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
            scaled_loss.backward()
            if poison:  # an overflow in this loss's grads only
                netD.main[0].weight.grad.view(-1)[0] = float("inf")

    g = torch.Generator().manual_seed(1)
    skipped = []
    for i in range(iters):
        real = torch.tanh(torch.randn(16, 12, generator=g) + 0.5).to(device)
        noise = torch.randn(16, 8, generator=g).to(device)
        ones = torch.ones(16, device=device)
        zeros = torch.zeros(16, device=device)
        # (1) update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        errD_real = criterion(netD(real), ones)
        backward(errD_real, optimizerD, 0)
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()), zeros)
        backward(errD_fake, optimizerD, 1, poison=(i == poison_fake_at))
        optimizerD.step()
        # (2) update G: maximize log(D(G(z)))
        netG.zero_grad()
        errG = criterion(netD(fake), ones)
        backward(errG, optimizerG, 2)
        optimizerG.step()
        if use_amp:
            skipped.append((amp.last_step_skipped(optimizerD),
                            amp.last_step_skipped(optimizerG)))
    params = [p.detach().clone() for m in (netD, netG) for p in m.parameters()]
    return params, skipped


@pytest.mark.parametrize("device", DEVICES)
def test_gan_three_losses_o0_matches_plain_torch(device):
    ref, _ = gan_script(device, "O0", use_amp=False)
    got, skipped = gan_script(device, "O0")
    assert _same(got, ref) and not any(a or b for a, b in skipped)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("device", DEVICES)
def test_gan_three_losses_overflow_in_one_loss(device, level):
    from adapters.apex.amp import _amp_state

    ref, _ = gan_script(device, "O0", use_amp=False)
    got, skipped = gan_script(device, level)
    assert not any(a or b for a, b in skipped)
    assert _close([p for p in got], ref, 2e-2)
    got, skipped = gan_script(device, level, poison_fake_at=2)
    # the overflow in errD_fake skips D's step of that iteration only, and halves
    # only loss scaler 1; G (its own loss, its own scaler) keeps stepping
    assert skipped == [(False, False), (False, False), (True, False), (False, False)]
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [65536.0, 32768.0, 65536.0]
    assert all(torch.isfinite(p).all() for p in got)


# ------------------------------------------------------------------------------------
# 2. fine-tuning: gradient accumulation, clip_grad_norm_ over amp.master_params
# ------------------------------------------------------------------------------------
class Classifier(nn.Module):
    """A small pretrained-style encoder with a fresh classification head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True), num_layers=2,
            enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def pretrained_weights():
    torch.manual_seed(42)
    return {k: v.clone() for k, v in Classifier().state_dict().items()}


def finetune_script(device, opt_level, steps=3, accumulation=4, use_amp=True):
    from adapters.apex import amp

    torch.manual_seed(0)
    model = Classifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if use_amp:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                          verbosity=0)
    # the pretrained checkpoint, loaded after initialize as many fine-tuning scripts do
    model.load_state_dict({k: v.to(device) for k, v in pretrained_weights().items()})
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(3)
    norms = []
    model.train()
    optimizer.zero_grad()
    for step in range(steps * accumulation):
        ids = torch.randint(0, 32, (4, 6), generator=g).to(device)
        labels = torch.randint(0, 3, (4,), generator=g).to(device)
        loss = criterion(model(ids).float(), labels) / accumulation
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        if (step + 1) % accumulation == 0:
            params = amp.master_params(optimizer) if use_amp else model.parameters()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("device", DEVICES)
def test_finetune_accumulation_clip_o0_matches_plain_torch(device):
    ref, ref_norms = finetune_script(device, "O0", use_amp=False)
    got, norms = finetune_script(device, "O0")
    assert _same(got, ref) and norms == ref_norms


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("device", DEVICES)
def test_finetune_accumulation_clip_mixed(device, level):
    ref, ref_norms = finetune_script(device, "O0", use_amp=False)
    got, norms = finetune_script(device, level)
    # the clipped norm is the true (unscaled, accumulated) one, and the pretrained
    # weights were fine-tuned (not the random init of the model: its distance is large)
    assert norms == pytest.approx(ref_norms, rel=2e-2)
    assert _close(got, ref, 5e-3)
    torch.manual_seed(0)
    init = [p.detach() for p in Classifier().parameters()]
    assert not _close(got, [t.to(got[0].device) for t in init], 0.05)


# ------------------------------------------------------------------------------------
# 3. checkpoint resume after loading pretrained weights
# ------------------------------------------------------------------------------------
def resume_setup(device, opt_level):
    """What a script does at start: build, initialize, load the pretrained weights."""
    from adapters.apex import amp

    torch.manual_seed(0)
    model = Classifier().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    model.load_state_dict({k: v.to(device) for k, v in pretrained_weights().items()})
    return model, optimizer


def resume_train(device, model, optimizer, start, stop):
    from adapters.apex import amp

    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 32, (4, 6), generator=g),
                torch.randint(0, 3, (4,), generator=g)) for _ in range(stop)]
    losses = []
    for ids, labels in batches[start:stop]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(ids.to(device)).float(), labels.to(device))
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O5"])
@pytest.mark.parametrize("device", DEVICES)
def test_resume_after_pretrained_is_identical(device, level):
    from adapters.apex import amp

    model, optimizer = resume_setup(device, level)
    first = resume_train(device, model, optimizer, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict()}, buf)
    rest = resume_train(device, model, optimizer, 3, 6)
    final = [p.detach().clone() for p in model.parameters()]
    # a fresh process: build and initialize again (the script's start-up), then restore
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)
    model2, optimizer2 = resume_setup(device, level)
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    resumed = resume_train(device, model2, optimizer2, 3, 6)
    assert resumed == rest and len(first) == 3
    assert _same([p.detach() for p in model2.parameters()], final)
