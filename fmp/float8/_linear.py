"""``Float8Linear``: ``nn.Linear`` computed as three float8 matmuls (``torch._scaled_mm``).

Forward ``out = x @ W.T``: input and weight cast to e4m3. Backward ``grad_x = g @ W`` and
``grad_W = g.T @ x``: the grad output cast to e5m2 (the recipe's ``bwd_format``), the saved
e4m3 input and weight reused (``_scaled_mm`` takes no e5m2 x e5m2 product). Each matmul
accumulates in float32 and writes its output in the dtype of the tensor it stands for (the
input's dtype for ``out`` and ``grad_x``, the weight's for ``grad_W``). ``_scaled_mm``
wants its second operand column-major and takes the inverse scales:
``_scaled_mm(a8, b8, 1/sa, 1/sb) = (a8/sa) @ (b8/sb)``, where ``a8 = saturate(a * sa)``.

Delayed scaling reports the step's amaxes through a *probe*: a zero float32 ``[3]`` tensor
the step differentiates with the params (``fmp/float8/_step.py``). The probe takes no part
in the forward; the backward returns ``(amax input, amax weight, amax grad output)`` as its
gradient. The grads the step computes hold the amaxes, with no side effect: it works under
``torch.func``, ``torch.compile(fullgraph=True)`` and CUDA graphs. The grad output's amax is
that of the grad as it arrives, scaled by the loss scale: the tensor that is cast.
"""

from __future__ import annotations

from typing import Any

import torch

from fmp.float8._cast import amax, scale_from, to_float8
from fmp.float8._context import lookup
from fmp.float8._recipe import Recipe, as_recipe, fp8_max

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHECKED: set[Any] = set()


def check_device(device: torch.device) -> None:
    """Raise where ``device`` is a CUDA GPU without float8 matmuls (capability < 8.9).

    Raises:
        RuntimeError: the GPU's capability is below (8, 9) (Ada, Hopper and newer have it).
    """
    if device.type != "cuda" or device in _CHECKED:
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise RuntimeError(
            f"fmp.float8 needs float8 matmuls (CUDA capability 8.9 or newer: Ada, Hopper), "
            f"but {device} ({torch.cuda.get_device_name(device)}) has capability "
            f"{cap[0]}.{cap[1]}; train this model without fmp.float8.convert")
    _CHECKED.add(device)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (same shape and values) laid out column-major, as ``_scaled_mm``'s mat2."""
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A float8 ``t`` with zero rows appended up to ``rows`` (through uint8: +0 is 0x00)."""
    if t.shape[0] == rows:
        return t
    pad = torch.zeros(rows - t.shape[0], t.shape[1], dtype=torch.uint8, device=t.device)
    return torch.cat([t.view(torch.uint8), pad]).view(t.dtype)


class _Float8Matmul(torch.autograd.Function):
    """``x[M, K] @ w[N, K].T`` in float8; see the module docstring."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, probe: torch.Tensor | None,
                s_x: torch.Tensor, s_w: torch.Tensor, s_g: torch.Tensor | None,
                a_x: torch.Tensor, a_w: torch.Tensor, margin: float, bwd_format: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq = to_float8(x, s_x, "e4m3").contiguous()  # row-major, whatever x's strides
        wq = to_float8(w, s_w, "e4m3").contiguous()
        out = torch._scaled_mm(xq, wq.t(), scale_a=s_x.reciprocal(), scale_b=s_w.reciprocal(),
                               out_dtype=x.dtype)
        return out, xq, wq

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, probe, s_x, s_w, s_g, a_x, a_w, margin, bwd_format = inputs
        _, xq, wq = output
        ctx.mark_non_differentiable(xq, wq)
        ctx.save_for_backward(xq, wq, s_x, s_w, s_g, a_x, a_w)
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        ctx.has_probe, ctx.margin, ctx.bwd_format = probe is not None, margin, bwd_format

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        xq, wq, s_x, s_w, s_g, a_x, a_w = ctx.saved_tensors
        a_g = amax(g)
        if s_g is None:  # dynamic: the grad's own amax now
            s_g = scale_from(a_g, fp8_max(ctx.bwd_format), ctx.margin, torch.ones_like(a_g))
        gq = to_float8(g, s_g, ctx.bwd_format).contiguous()
        inv_g = s_g.reciprocal()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(gq, _col_major(wq), scale_a=inv_g,
                                      scale_b=s_w.reciprocal(), out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            rows = -(-gq.shape[0] // 16) * 16  # the inner dim of g.T @ x: a multiple of 16
            grad_w = torch._scaled_mm(_pad_rows(gq, rows).t().contiguous(),
                                      _col_major(_pad_rows(xq, rows)), scale_a=inv_g,
                                      scale_b=s_x.reciprocal(), out_dtype=ctx.w_dtype)
        probe_grad = torch.stack([a_x, a_w, a_g]) if ctx.has_probe else None
        return grad_x, grad_w, probe_grad, None, None, None, None, None, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: Recipe, name: str | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` through float8 matmuls.

    Inside a train step whose state holds float8 records, the record named ``name`` gives
    the scaling (delayed: its scales; dynamic: the current amaxes); elsewhere the scaling
    is dynamic with ``recipe``'s margin and formats.

    Args:
        x: ``[..., in_features]``, float32, bfloat16 or float16 (the output's dtype).
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None (added in the output dtype).
        recipe: the layer's :class:`fmp.float8.Recipe`.
        name: the layer's qualified name (its record's key).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        ValueError: ``x``'s dtype is not one of the three above; see also
            :func:`fmp.float8._context.lookup`.
        RuntimeError: ``x`` is on a GPU without float8 matmuls.

    Example:
        >>> y = float8_linear(torch.randn(4, 16), torch.randn(16, 16), None, Recipe())
        >>> y.shape, y.dtype
        (torch.Size([4, 16]), torch.float32)
    """
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"Float8Linear {name!r}: the input is {x.dtype}; float8 matmuls take "
                         f"inputs in {[str(d) for d in _OUT_DTYPES]}")
    if not torch.compiler.is_compiling():
        check_device(x.device)
    record, probe = lookup(name)
    margin = recipe.margin if record is None else record.margin
    bwd = recipe.bwd_format if record is None else record.bwd_format
    x2 = x.reshape(-1, x.shape[-1])
    a_x, a_w = amax(x2), amax(weight)
    if record is not None and record.delayed:  # the scales the history gave
        s_x, s_w, s_g = record.scale[0], record.scale[1], record.scale[2]
    else:
        top = fp8_max("e4m3")
        s_x = scale_from(a_x, top, margin, torch.ones_like(a_x))
        s_w = scale_from(a_w, top, margin, torch.ones_like(a_w))
        s_g = None
    out, _, _ = _Float8Matmul.apply(x2, weight, probe, s_x, s_w, s_g, a_x, a_w, margin, bwd)
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def check_features(in_features: int, out_features: int, what: str) -> None:
    """Raise unless both sizes are multiples of 16 (``_scaled_mm`` on CUDA needs it)."""
    if in_features % 16 or out_features % 16:
        raise ValueError(f"{what}: in_features={in_features} and out_features={out_features} "
                         "must both be multiples of 16 for float8 matmuls")


class Float8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 (same parameters, same names).

    Made by :func:`fmp.float8.convert` from a model's ``nn.Linear`` layers, or directly.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (both sizes
            multiples of 16).
        recipe: a :class:`fmp.float8.Recipe` or ``"dynamic"`` / ``"delayed"``.
        name: its qualified name in the model (the key of its record in
            ``TrainState.float8``; :func:`fmp.float8.init` sets it).

    Raises:
        ValueError: a size is not a multiple of 16, or the recipe is bad.

    Example:
        >>> layer = fmp.float8.Float8Linear(16, 32, recipe="dynamic")
        >>> layer(torch.randn(2, 16)).shape
        torch.Size([2, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Any = None, *, recipe: Recipe | str = "dynamic",
                 name: str | None = None) -> None:
        check_features(in_features, out_features, "Float8Linear")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = as_recipe(recipe)
        self.float8_name = name

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Recipe | str,
                    name: str | None = None) -> Float8Linear:
        """``linear`` itself, now a Float8Linear: its parameters (tied ones too) unchanged.

        Raises:
            ValueError: a size is not a multiple of 16.
        """
        check_features(linear.in_features, linear.out_features, f"Float8Linear {name!r}")
        recipe = as_recipe(recipe)
        linear.__class__ = cls
        linear.recipe = recipe
        linear.float8_name = name
        return linear  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.recipe, self.float8_name)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scaling={self.recipe.scaling!r}"
