"""Composition of transformations, and which capabilities of its parts a chain keeps."""

from __future__ import annotations

from typing import Any

import torch

from fmp.optim._base import GradientTransformation, _capability, _Update
from fmp.optim._inplace import _OnlyPartInPlace


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: the updates of each feed the next.

    The chain's learning-rate check (:func:`schedule_ok`) combines those of its parts. It
    keeps the in-place fused form (:func:`update_in_place`) only when it has exactly one
    part and that part has one: the fused kernels compute one optimizer's formulas, never
    a composition. A longer chain takes the pure path (with ``train_step(donate=True)``:
    the pure update, written into the donated tensors).

    Args:
        *transforms: :class:`GradientTransformation` objects, applied left to right.
            Each ``update`` receives the same ``params``.

    Returns:
        A :class:`GradientTransformation` whose state is the tuple of the sub-states.

    Raises:
        TypeError: an argument is not a :class:`GradientTransformation`.
        ValueError: (in ``update``) the state is not a tuple of one sub-state per
            transformation.

    Example:
        >>> opt = fmp.optim.chain(fmp.optim.add_decayed_weights(1e-4),
        ...                       fmp.optim.trace(0.9),
        ...                       fmp.optim.scale_by_learning_rate(0.1))
        >>> len(opt.init({"w": torch.ones(2)}))
        3
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is a {type(t).__name__}, expected a "
                "GradientTransformation"
            )

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, Any]:
        if not (isinstance(state, tuple) and len(state) == len(transforms)):
            raise ValueError(
                f"chain.update: state must be a tuple of {len(transforms)} sub-states, got "
                f"{type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_states = []
        for t, s in zip(transforms, state, strict=True):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    parts = [_capability(t) for t in transforms]
    checks = [(i, u.schedule_check) for i, u in enumerate(parts)
              if u is not None and u.schedule_check is not None]

    def check(state: tuple[Any, ...]) -> torch.Tensor:
        ok = checks[0][1](state[checks[0][0]])
        for i, c in checks[1:]:
            ok = ok & c(state[i])
        return ok

    only = parts[0] if len(parts) == 1 else None
    in_place = None if only is None or only.in_place is None else _OnlyPartInPlace(only.in_place)
    return GradientTransformation(
        init, _Update(update, schedule_check=check if checks else None, in_place=in_place))
