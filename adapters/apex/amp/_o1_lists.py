"""The cast lists of Apex's O1 (NVIDIA/apex ``amp/lists`` at e13873de), by function name.

Each list names functions of ``torch.nn.functional``, ``torch`` or ``torch.Tensor``. The
rules (what a list does to the arguments) live in :mod:`adapters.apex.amp._o1_mode`;
:func:`build_rules` turns the names into a table keyed by the function objects that
``__torch_function__`` receives (operators arrive as their methods: ``a @ b`` as
``Tensor.matmul``, ``a - b`` as ``Tensor.sub``, ``a += b`` as ``Tensor.add_``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# --- torch.nn.functional ---------------------------------------------------------------
_F_HALF = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "conv_tbc", "linear"]
_F_FLOAT = [
    "interpolate", "softplus", "softmin", "log_softmax", "softmax", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss",
]
_F_BANNED = ["binary_cross_entropy"]

# --- torch -------------------------------------------------------------------------------
# Apex put the batched matmuls on the half list for CUDA >= 9.1 (every CUDA build today).
_T_HALF = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm",
           "mv", "addbmm", "baddbmm", "bmm"]
_T_FLOAT = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm",
            "prod", "std", "sum", "var", "renorm"]
_T_PROMOTE = ["addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul",
              "eq", "equal", "ge", "gt", "le", "lt", "ne"]
_T_SEQUENCE = ["cat", "stack"]
_T_RNN = ["rnn_relu", "rnn_tanh", "gru", "lstm"]

# --- torch.Tensor (plus every torch name above that Tensor also has) ---------------------
_M_HALF = ["__matmul__"]
_M_FLOAT = ["__ipow__", "__pow__", "__rpow__"]
_M_PROMOTE = ["__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__",
              "__imul__", "__isub__", "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__",
              "__radd__", "__rdiv__", "__rmul__", "__rsub__", "__rtruediv__", "__sub__",
              "__truediv__",
              # how the operators above reach __torch_function__ today
              "sub", "true_divide"]

BANNED_MESSAGE = (
    "amp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss`: "
    "it requires the output of the previous function to be float32 already, and here an "
    "argument is {dtype}. Most models have a sigmoid right before BCELoss: use "
    "torch.nn.BCEWithLogitsLoss (sigmoid + BCE in one layer, cast to float32 by amp), or "
    "call amp.register_float_function(torch, 'sigmoid') before amp.initialize / amp.init. "
    "If you really know what you are doing, pass allow_banned=True to amp.init() to run it "
    "in float32.")


def _objs(owner: Any, name: str) -> list[Any]:
    """The function objects ``owner.name`` may reach ``__torch_function__`` as."""
    out = []
    for o in (owner, getattr(torch._C, "TensorBase", None) if owner is torch.Tensor else None):
        f = getattr(o, name, None) if o is not None else None
        if f is not None and f not in out:
            out.append(f)
    return out


def build_rules() -> dict[Any, tuple[str, str]]:
    """The table ``function object -> (rule, name)`` for Apex's lists.

    Rules: ``half``, ``float``, ``promote``, ``sequence``, ``banned``, ``rnn``,
    ``inplace_any`` (an in-place torch function of the float list: refused on any half
    argument), ``inplace_self`` (an in-place method of the float list: refused on a half
    ``self``, else the other arguments go to float32), ``match_self`` (other in-place
    methods: the arguments take ``self``'s dtype), ``cpu`` (``Tensor.cpu``: float32
    before the transfer).

    Returns:
        The table; later entries never override earlier ones.

    Example:
        >>> build_rules()[torch.mm]
        ('half', 'mm')
    """
    rules: dict[Any, tuple[str, str]] = {}

    def put(owner: Any, names: list[str], rule: str) -> None:
        for n in names:
            for f in _objs(owner, n):
                rules.setdefault(f, (rule, n))

    put(F, _F_BANNED, "banned")
    put(F, _F_HALF, "half")
    put(F, _F_FLOAT, "float")
    put(torch, _T_HALF, "half")
    put(torch, _T_FLOAT, "float")
    put(torch, _T_RNN, "rnn")
    put(torch, [n + "_cell" for n in _T_RNN], "half")
    put(torch.Tensor, ["cpu"], "cpu")
    put(torch.Tensor, _M_HALF + _T_HALF, "half")
    put(torch.Tensor, _M_FLOAT + _T_FLOAT, "float")
    # in-place versions (before the promote lists: `add_` is not `add`)
    put(torch, [n + "_" for n in _T_FLOAT], "inplace_any")
    put(torch.Tensor, [n + "_" for n in _T_FLOAT], "inplace_self")
    put(torch.Tensor, [n + "_" for n in _M_HALF + _T_HALF + _M_PROMOTE + _T_PROMOTE],
        "match_self")
    put(torch, _T_PROMOTE, "promote")
    put(torch.Tensor, _M_PROMOTE + _T_PROMOTE, "promote")
    put(torch, _T_SEQUENCE, "sequence")
    return rules
