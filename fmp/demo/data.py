"""The demo's data: scikit-learn's handwritten digits as tensors, split by a seed.

The 1,797 8×8 grey-level images ship inside scikit-learn (``sklearn.datasets.load_digits``),
so nothing is downloaded. Pixels (0..16) are scaled to [0, 1].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DigitsSplit", "batch_indices", "load_digits_split"]

#: Number of images in the dataset and its classes.
NUM_IMAGES = 1797
NUM_CLASSES = 10


class DigitsSplit(NamedTuple):
    """A train/test split of the digits, as tensors.

    Attributes:
        x_train: float32 images, shape ``(n_train, 1, 8, 8)``, values in [0, 1].
        y_train: int64 labels in ``0..9``, shape ``(n_train,)``.
        x_test: float32 images, shape ``(n_test, 1, 8, 8)``.
        y_test: int64 labels, shape ``(n_test,)``.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device | str) -> DigitsSplit:
        """The same split with every tensor on ``device``.

        Args:
            device: e.g. ``"cuda"``.

        Returns:
            A new :class:`DigitsSplit`.
        """
        return DigitsSplit(*(t.to(device) for t in self))


def load_digits_split(seed: int = 0, test_fraction: float = 0.2,
                      device: torch.device | str = "cpu") -> DigitsSplit:
    """Load the digits and split them, stratified by class, with a fixed seed.

    Args:
        seed: the seed of the split (the same seed always gives the same split).
        test_fraction: the share of images held out for testing, in (0, 1).
        device: where the tensors are put.

    Returns:
        A :class:`DigitsSplit` (with the default fraction: 1,437 train, 360 test images).

    Raises:
        ValueError: ``test_fraction`` is not in (0, 1).
        ModuleNotFoundError: scikit-learn is missing (install the ``demo`` extra).

    Example:
        >>> split = load_digits_split(seed=0)
        >>> split.x_train.shape, split.x_test.shape
        (torch.Size([1437, 1, 8, 8]), torch.Size([360, 1, 8, 8]))
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction!r}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the fmp demo needs scikit-learn for its dataset: pip install -e '.[demo]'"
        ) from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=test_fraction, random_state=seed,
        stratify=y.numpy())
    tr, te = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
    return DigitsSplit(x[tr], y[tr], x[te], y[te]).to(device)


def batch_indices(n: int, batch_size: int, steps: int, seed: int = 0) -> torch.Tensor:
    """Indices of ``steps`` mini-batches: shuffled epochs, the last partial batch dropped.

    Every policy of a demo run gets the same indices, so they see the same batches in the
    same order.

    Args:
        n: the number of training examples.
        batch_size: examples per batch, in ``[1, n]``.
        steps: the number of batches.
        seed: the seed of the shuffles.

    Returns:
        An int64 tensor of shape ``(steps, batch_size)`` (on the CPU).

    Raises:
        ValueError: ``batch_size`` is not in ``[1, n]`` or ``steps`` is negative.

    Example:
        >>> batch_indices(10, 4, 3).shape
        torch.Size([3, 4])
    """
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must lie in [1, {n}], got {batch_size}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    g = torch.Generator().manual_seed(seed)
    per_epoch = n // batch_size
    epochs = -(-steps // per_epoch) if steps else 0
    rows = [torch.randperm(n, generator=g)[: per_epoch * batch_size].view(per_epoch, batch_size)
            for _ in range(epochs)]
    if not rows:
        return torch.empty(0, batch_size, dtype=torch.int64)
    return torch.cat(rows)[:steps]
