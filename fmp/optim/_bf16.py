"""Params stored in bfloat16 with no float32 copy: Kahan-compensated or stochastically
rounded writes (:func:`kahan_summation`, :func:`stochastic_rounding`).

Each is the *last* transformation of a chain: it receives the optimizer's update (float32
for bf16 params) and the params, and returns the float32 delta ``written - param`` of the
bf16 value to write. :func:`apply_updates` (``param + delta`` in float32, rounded once to
bf16) then reproduces ``written`` exactly, since both are bf16 values whose difference
float32 holds exactly (exponents at most 15 apart: the param is not shrunk more than
2**15-fold in one step). The compensation is taken against what :func:`apply_updates`
writes (computed the same way), so even then nothing is lost from the running sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fmp.optim._base import GradientTransformation
from fmp.optim._bits import leaf_seed, random16, round_bf16, stochastic_round_bf16
from fmp.optim._chain import chain
from fmp.optim._leafwise import _flatten_like, _flatten_params

_LOW = (torch.bfloat16,)
BF16_UPDATES = ("kahan", "stochastic")


class KahanState(NamedTuple):
    """State of :func:`kahan_summation`.

    Attributes:
        compensation: a tree like the params: for each bfloat16 param the part of the
            updates its stored value lost to rounding so far (bf16, same shape); for
            float32 / float64 params an empty tensor (their updates pass through).

    Example:
        >>> fmp.optim.kahan_summation().init({"w": torch.ones(2, dtype=torch.bfloat16)})
        KahanState(compensation={'w': tensor([0., 0.], dtype=torch.bfloat16)})
    """

    compensation: Any


class StochasticRoundingState(NamedTuple):
    """State of :func:`stochastic_rounding`.

    Attributes:
        key: 0-d int64 tensor, ``seed * 2**32 + updates so far``; the random bits of an
            update are a function of it (a skipped step keeps it, so it does not move).

    Example:
        >>> fmp.optim.stochastic_rounding(seed=3).init({}).key
        tensor(12884901888)
    """

    key: torch.Tensor


def _device(leaves: list[torch.Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


def _leaves(fn: str, updates: Any, params: Any) -> tuple[list[Any], list[Any], Any]:
    if params is None:
        raise ValueError(f"{fn}.update needs params (it computes the value written into "
                         "each param); got params=None")
    u, spec = optree.tree_flatten(updates)
    p = _flatten_like(params, spec, "params", "updates")
    for i, (a, b) in enumerate(zip(u, p, strict=True)):
        if getattr(a, "shape", None) != getattr(b, "shape", None):
            path = ".".join(map(str, spec.paths()[i]))
            raise ValueError(f"{fn}.update: updates leaf {path!r} has shape "
                             f"{tuple(a.shape)} but its param {tuple(b.shape)}")
    return u, p, spec


def _no_float16(fn: str, where: str, leaves: list[torch.Tensor], spec: Any) -> None:
    for i, x in enumerate(leaves):
        if x.dtype == torch.float16:
            path = ".".join(map(str, spec.paths()[i]))
            raise ValueError(f"{fn}.{where}: param {path!r} is float16; {fn} supports "
                             "bfloat16 params (float32 / float64 pass through); float16 "
                             "params want float32 masters (the 'fp16-mixed' policy)")


def kahan_summation() -> GradientTransformation:
    """Kahan-compensated writes into bfloat16 params (no float32 master copy).

    The last part of a chain (``sgd`` / ``adam`` / ``adamw(..., bf16_update="kahan")`` build
    ``chain(optimizer, kahan_summation())``). Per bf16 param ``p`` with incoming
    update ``u`` and compensation ``c``, in float32::

        t = p + (u + c)            # the value p would take with exact storage
        w = round(t)               # the bf16 value written (round to nearest even)
        delta = w - p              # returned: apply_updates(p, delta) writes w exactly
        c = round(t - w)           # what rounding lost, carried to the next update

    so updates far below the bf16 spacing of ``p`` accumulate in ``c`` until they move it.
    float32 / float64 params keep an empty buffer and get ``u`` unchanged. State: one bf16
    buffer per bf16 param (2 bytes per param). The roundings are integer ops, so a
    compiled update rounds as the eager one.

    Returns:
        A :class:`GradientTransformation` with state :class:`KahanState`; its ``update``
        needs ``params``.

    Raises:
        ValueError: (in ``init``) a float16 param (the compensation is for bfloat16;
            float16 wants float32 masters: ``"fp16-mixed"``) or a non-floating leaf; (in
            ``update``) params are missing or differ in structure or shape from the updates.

    Example:
        >>> opt = fmp.optim.chain(fmp.optim.sgd(1e-3), fmp.optim.kahan_summation())
        >>> p = {"w": torch.ones(1, dtype=torch.bfloat16)}
        >>> s = opt.init(p)
        >>> for _ in range(10):
        ...     u, s = opt.update({"w": -torch.ones(1)}, s, p)
        ...     p = fmp.optim.apply_updates(p, u)
        >>> p["w"]  # plain bf16 would stay at 1.0: 1e-3 is below half its spacing
        tensor([1.0078], dtype=torch.bfloat16)
    """
    fn = "kahan_summation"

    def init(params: Any) -> KahanState:
        leaves, spec = _flatten_params(fn, params)
        _no_float16(fn, "init", leaves, spec)
        comp = [torch.zeros_like(x) if x.dtype in _LOW
                else torch.zeros(0, dtype=x.dtype, device=x.device) for x in leaves]
        return KahanState(optree.tree_unflatten(spec, comp))

    def update(updates: Any, state: KahanState, params: Any = None) -> tuple[Any, KahanState]:
        if not isinstance(state, KahanState):
            raise TypeError(f"{fn}.update: the state is a {type(state).__name__}, expected the "
                            "KahanState made by kahan_summation().init(params)")
        u, p, spec = _leaves(fn, updates, params)
        c = _flatten_like(state.compensation, spec, "state.compensation", "updates")
        _no_float16(fn, "update", p, spec)
        low = [i for i, x in enumerate(p) if x.dtype in _LOW]
        for i in low:
            if c[i].shape != p[i].shape or c[i].dtype != p[i].dtype:
                raise ValueError(f"{fn}.update: the compensation of leaf "
                                 f"{'.'.join(map(str, spec.paths()[i]))!r} is "
                                 f"{c[i].dtype} {tuple(c[i].shape)}, its param "
                                 f"{p[i].dtype} {tuple(p[i].shape)}: the state was made for "
                                 "other params (rebuild it with optimizer.init(params))")
        if not low:
            return updates, state
        f32 = torch.float32
        pf = [p[i].to(f32) for i in low]
        y = torch._foreach_add([u[i].to(f32) for i in low], [c[i].to(f32) for i in low])
        t = torch._foreach_add(pf, y)
        # rounding with integer ops (round_bf16), never a cast pair inductor may elide
        delta = torch._foreach_sub([round_bf16(x) for x in t], pf)
        # what apply_updates writes: p + delta in float32, rounded to the param's dtype
        written = [round_bf16(w) for w in torch._foreach_add(pf, delta)]
        lost = torch._foreach_sub(t, written)
        out, new_c = list(u), list(c)
        for k, i in enumerate(low):
            out[i], new_c[i] = delta[k], lost[k].to(p[i].dtype)
        return (optree.tree_unflatten(spec, out),
                KahanState(optree.tree_unflatten(spec, new_c)))

    return GradientTransformation(init, update)


def _check_seed(fn: str, seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"{fn}: invalid seed {seed!r}; accepted: an int in [0, 2**31)")
    return seed


def stochastic_rounding(seed: int = 0) -> GradientTransformation:
    """Stochastically rounded writes into bfloat16 params (no float32 master copy).

    The last part of a chain (``sgd`` / ``adam`` / ``adamw(..., bf16_update="stochastic")``
    build ``chain(optimizer, stochastic_rounding())``). Per bf16 param ``p`` with update
    ``u``: ``t = p + u`` in float32, then ``w`` is one of the two bf16 neighbours of ``t``,
    the upper one with probability ``(t - lower) / (upper - lower)``, so ``E[w] = t``: tiny
    updates move ``p`` on average instead of vanishing. Returns ``w - p`` in float32, which
    :func:`apply_updates` writes exactly. The random bits are a counter-based hash of the
    state's ``key``, the leaf and the element index: no global RNG, no host sync, the same
    on every device; the key moves by one per update (not on a skipped step), so a resumed
    checkpoint rounds as the uninterrupted run. Params of float32 / float64 pass through.

    Args:
        seed: an int in [0, 2**31); runs with different seeds round independently.

    Returns:
        A :class:`GradientTransformation` with state :class:`StochasticRoundingState`; its
        ``update`` needs ``params``.

    Raises:
        ValueError: a bad seed; (in ``init``) a float16 param (stochastic rounding is for
            bfloat16) or a non-floating leaf; (in ``update``)
            params are missing or differ in structure or shape from the updates.

    Example:
        >>> opt = fmp.optim.chain(fmp.optim.sgd(1e-3), fmp.optim.stochastic_rounding())
        >>> p = {"w": torch.ones(1000, dtype=torch.bfloat16)}
        >>> u, s = opt.update({"w": -torch.ones(1000)}, opt.init(p), p)
        >>> round(fmp.optim.apply_updates(p, u)["w"].double().mean().item(), 2)
        1.0
    """
    fn = "stochastic_rounding"
    seed = _check_seed(fn, seed)

    def init(params: Any) -> StochasticRoundingState:
        leaves, spec = _flatten_params(fn, params)
        _no_float16(fn, "init", leaves, spec)
        return StochasticRoundingState(torch.tensor(seed << 32, dtype=torch.int64,
                                                    device=_device(leaves)))

    def update(updates: Any, state: StochasticRoundingState, params: Any = None
               ) -> tuple[Any, StochasticRoundingState]:
        if not isinstance(state, StochasticRoundingState):
            raise TypeError(f"{fn}.update: the state is a {type(state).__name__}, expected the "
                            "StochasticRoundingState made by stochastic_rounding().init(params)")
        u, p, spec = _leaves(fn, updates, params)
        _no_float16(fn, "update", p, spec)
        out = list(u)
        for i, (a, x) in enumerate(zip(u, p, strict=True)):
            if x.dtype != torch.bfloat16:
                continue
            pf = x.to(torch.float32)
            t = pf + a.to(torch.float32)
            w = stochastic_round_bf16(t, random16(leaf_seed(state.key, i), t.shape))
            out[i] = w.to(torch.float32) - pf
        return optree.tree_unflatten(spec, out), StochasticRoundingState(state.key + 1)

    return GradientTransformation(init, update)


def with_bf16_update(fn: str, optimizer: GradientTransformation,
                     bf16_update: object) -> GradientTransformation:
    """``optimizer`` followed by the bf16 write named by ``bf16_update`` (None: as it is)."""
    if bf16_update is None:
        return optimizer
    if bf16_update == "kahan":
        return chain(optimizer, kahan_summation())
    if bf16_update == "stochastic":
        return chain(optimizer, stochastic_rounding())
    raise ValueError(f"{fn}: invalid bf16_update {bf16_update!r}; accepted: None, 'kahan' "
                     "(a bf16 compensation buffer per param) or 'stochastic' (stochastic "
                     "rounding of the written value)")


for _cls in (KahanState, StochasticRoundingState):
    _cls.__module__ = "fmp.optim"
del _cls
