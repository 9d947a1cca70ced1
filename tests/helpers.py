"""Small models, data and fault injection shared by the tests."""

from __future__ import annotations

import optree
import torch


def mlp(d_in: int = 8, hidden: int = 32, d_out: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d_out)
    )


def blobs(n: int = 256, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two separable Gaussian classes: a loss that a few steps of training lowers clearly."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    centers = torch.randn(2, d, generator=g) * 2.0
    x = centers[y] + torch.randn(n, d, generator=g)
    return x, y


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor``.

    ``factor = inf`` (or nan) injects a non-finite value into every gradient flowing back
    through it while leaving the loss finite.
    """

    @staticmethod
    def forward(x, factor):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (factor,) = ctx.saved_tensors
        return g * factor.to(g.dtype), None


def clone_tree(tree):
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def assert_trees_bit_equal(a, b) -> None:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb, (sa, sb)
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (any layout)
            assert torch.equal(bits(x), bits(y)), (x, y)
        else:
            assert x == y


def has_nan(tree) -> bool:
    return any(
        isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.isfinite(x).all()
        for x in optree.tree_leaves(tree)
    )
