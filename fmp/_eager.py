"""Whether the in-place multi-tensor kernels may run: plain eager mode."""

from __future__ import annotations

import torch


def eager_kernels_ok() -> bool:
    """True in plain eager mode: not being compiled, not inside a torch.func transform.

    The step's in-place kernels (the amp unscale, torch's fused optimizers) run only there:
    under ``torch.compile`` inductor fuses the pure path itself, and functionalization
    rejects in-place kernels on the step's inputs.
    """
    return (not torch.compiler.is_compiling()
            and torch._C._functorch.peek_interpreter_stack() is None)
