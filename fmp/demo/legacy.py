"""The demo's Apex-style legacy loop: ``torch.optim`` + ``amp.initialize`` + ``scale_loss``.

This is the loop a pre-2025 NVIDIA Apex user wrote, with one line changed:
``from apex import amp`` became ``from adapters import apex`` (``apex.amp``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from adapters import apex
from fmp.demo.data import DigitsSplit, batch_indices
from fmp.demo.model import make_model

__all__ = ["train"]


def train(level: str, data: DigitsSplit, cfg: Any, device: torch.device,
          bar: Any) -> dict[str, Any]:
    """Train the demo's CNN with an Apex opt level and evaluate it.

    Same initial weights, batches and learning-rate schedule as the functional runs
    (``torch.optim.AdamW`` with a cosine ``LambdaLR``).

    Args:
        level: an Apex opt level, ``"O0"`` ... ``"O5"``.
        data: the split, on ``device``.
        cfg: the :class:`fmp.demo.run.DemoConfig`.
        device: where to train.
        bar: a tqdm progress bar (closed here).

    Returns:
        A dict: ``losses`` and ``scales`` (lists of 0-d tensors, one per step),
        ``skipped`` (int), ``elapsed`` (seconds, the first step excluded) and
        ``accuracy`` (percent on the test split).

    Raises:
        Whatever ``amp.initialize`` raises for a bad opt level.
    """
    from fmp.demo.run import cosine_lr

    amp = apex.amp.Amp()  # an own instance: each run starts from a fresh amp state
    model = make_model(cfg.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    schedule = cosine_lr(1.0, cfg.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: schedule(n))

    idx = batch_indices(len(data.y_train), cfg.batch_size, cfg.steps, cfg.seed).to(device)
    losses: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    skipped = 0
    t0 = time.perf_counter()
    with bar:
        for i in range(cfg.steps):
            b = idx[i]
            loss = F.cross_entropy(model(data.x_train[b]).float(), data.y_train[b])
            optimizer.zero_grad(set_to_none=True)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()  # a no-op after an overflow
            scheduler.step()
            skipped += int(amp.last_step_skipped(optimizer))
            losses.append(loss.detach().float())
            scales.append(torch.tensor(amp.loss_scale()))
            if i == 0:
                t0 = time.perf_counter()
            if (i + 1) % 25 == 0 or i + 1 == cfg.steps:
                bar.set_postfix(loss=f"{float(losses[-1]):.3f}", refresh=False)
            bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test).float()
    accuracy = 100.0 * (logits.argmax(-1) == data.y_test).float().mean().item()
    apex.amp.deactivate()  # O1/O4 casts act process-wide, as Apex's patches did
    return {"losses": losses, "scales": scales, "skipped": skipped, "elapsed": elapsed,
            "accuracy": accuracy}
