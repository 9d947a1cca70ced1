"""The demo's model: a small convolutional network for 8×8 digits."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DigitsCNN", "make_model"]


class DigitsCNN(nn.Module):
    """conv(1→c1, 3×3) → GELU → conv(c1→c2, 3×3) → GELU → 2×2 max-pool → linear(→10).

    Unpadded convolutions take an 8×8 image to 6×6 then 4×4, the pool to 2×2, so the
    head sees ``4 * c2`` features. Small on purpose: on CPUs without native bf16/fp16
    arithmetic, low-precision convolutions are several times slower than float32 ones.

    Args:
        c1: channels of the first convolution.
        c2: channels of the second convolution.
        num_classes: outputs of the head.

    Example:
        >>> DigitsCNN()(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, c1: int = 16, c2: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3)
        self.conv2 = nn.Conv2d(c1, c2, 3)
        self.head = nn.Linear(4 * c2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images.

        Args:
            x: images of shape ``(batch, 1, 8, 8)``.

        Returns:
            Logits of shape ``(batch, num_classes)``, in the dtype of the computation.
        """
        x = nn.functional.gelu(self.conv1(x))
        x = nn.functional.gelu(self.conv2(x))
        x = nn.functional.max_pool2d(x, 2)
        return self.head(x.flatten(1))


def make_model(seed: int = 0, device: torch.device | str = "cpu", **kwargs: int) -> DigitsCNN:
    """A :class:`DigitsCNN` whose initial weights depend only on ``seed``.

    Args:
        seed: the seed of the initialisation (the global RNG is left untouched).
        device: where the parameters are put.
        **kwargs: passed to :class:`DigitsCNN` (``c1``, ``c2``).

    Returns:
        The model, in float32, in training mode.

    Example:
        >>> a, b = make_model(1), make_model(1)
        >>> torch.equal(a.conv1.weight, b.conv1.weight)
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCNN(**kwargs)
    return model.to(device)
