"""``fmp.TrainState``: everything a train step reads and returns, as one immutable record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

from fmp._donation import claim, hand_over
from fmp.float8._convert import check_records
from fmp.loss_scale import NoOpLossScale
from fmp.optim import GradientTransformation
from fmp.tree import floating_leaves


class TrainState(NamedTuple):
    """Everything a train step reads and returns: an immutable record (a pytree).

    Attributes:
        params: the params tree, in the policy's param dtype.
        opt_state: the optimizer's state (``optimizer.init(params)``).
        loss_scale: a loss-scale record (:class:`fmp.NoOpLossScale`, :class:`fmp.StaticLossScale`
            or :class:`fmp.DynamicLossScale`).
        step: 0-d int64 tensor, the number of step calls so far (skipped ones included).
        model_state: buffers such as BatchNorm running statistics, or None.
        skipped_total: 0-d int32 tensor, how many steps were skipped (never reset).
        compute_params: the params cast to the compute dtype, written by the last step's
            update (``train_step(..., compute_copy=True)``, mixed policies), or None. A
            cache: the next step reads it instead of casting the params, and rebuilds it
            whenever it cannot tell that it is current (see :func:`train_step`).
        float8: ``{qualified name: fmp.float8.Float8LinearScales}`` of a model converted
            with :func:`fmp.float8.convert` (:func:`fmp.float8.init`), or None. The step
            updates the delayed-scaling records from the amaxes its float8 layers saw, and
            keeps them only where it applies the update.

    Example:
        >>> state = fmp.TrainState.create({"w": torch.zeros(3)}, fmp.optim.sgd(0.1))
        >>> int(state.step), int(state.skipped_total)
        (0, 0)
    """

    params: Any
    opt_state: Any
    loss_scale: Any
    step: torch.Tensor
    model_state: Any = None
    skipped_total: torch.Tensor | None = None
    compute_params: Any = None
    float8: Any = None

    @classmethod
    def create(cls, params: Any, optimizer: GradientTransformation, loss_scale: Any = None,
               model_state: Any = None, float8: Any = None, *,
               donate: bool = False) -> TrainState:
        """Initialise a state: optimizer state, counters, and the loss scale on the params' device.

        Args:
            params: the params tree (e.g. from :func:`fmp.functional`).
            optimizer: a :class:`fmp.optim.GradientTransformation`.
            loss_scale: a loss-scale record; None means :class:`fmp.NoOpLossScale`.
            model_state: buffers to carry (for ``train_step(..., has_state=True)``).
            float8: the float8 records, ``fmp.float8.init(model)``, or None.
            donate: hand ``params`` and ``model_state`` themselves to a step built with
                ``donate=True``: it writes its updates into these tensors instead of first
                copying them, so no second copy of the params is held and the module
                :func:`fmp.functional` split them from sees every update in place (as with
                ``torch.optim``). Without it (the default) the first donated step copies
                them once and the module keeps its values. Only for tensors nothing else
                reads as the old values.

        Returns:
            A :class:`TrainState` with ``step`` 0 (int64) and ``skipped_total`` 0 (int32).

        Raises:
            TypeError: ``optimizer`` is not a GradientTransformation, ``loss_scale`` is
                not a loss-scale record, or ``float8`` is not a dict of float8 records.
            ValueError: with ``donate=True``, a tensor is already held by another state
                or a step's output, or two leaves share storage (tied weights, views).
        """
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(f"optimizer must be an fmp.optim.GradientTransformation, got "
                            f"{type(optimizer).__name__}")
        if loss_scale is None:
            loss_scale = NoOpLossScale()
        if not (hasattr(loss_scale, "scale") and hasattr(loss_scale, "adjust")):
            raise TypeError(f"loss_scale must be an fmp loss-scale record (NoOpLossScale, "
                            f"StaticLossScale, DynamicLossScale) or None, got "
                            f"{type(loss_scale).__name__}")
        if float8 is not None:
            float8 = check_records(float8)
        leaves = floating_leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        opt_state = optimizer.init(params)
        given = {id(x) for x in optree.tree_leaves(params)}
        if donate:  # a refusal (ValueError) leaves every tensor as it was
            hand_over({"params": params, "model_state": model_state})
        claim([x for x in optree.tree_leaves(opt_state) if id(x) not in given])
        return cls(
            params=params,
            opt_state=opt_state,
            loss_scale=loss_scale.to(device),
            step=torch.zeros((), dtype=torch.int64, device=device),
            model_state=model_state,
            skipped_total=torch.zeros((), dtype=torch.int32, device=device),
            float8=float8,
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as a nested dict of tensors and plain values (:mod:`fmp.checkpoint`).

        Returns:
            A dict for ``torch.save`` or ``torch.distributed.checkpoint``; its tensors are
            this state's own. ``compute_params`` is left out (the next step rebuilds it).

        Example:
            >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.sgd(0.1))
            >>> sorted(s.state_dict()["params"])
            ['w']
        """
        from fmp.checkpoint import state_dict

        return state_dict(self)

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> TrainState:
        """Rebuild a state from :meth:`state_dict`'s output, exactly (:mod:`fmp.checkpoint`).

        Args:
            d: the state dict (e.g. ``torch.load(path)``, or one DCP loaded into).

        Returns:
            The :class:`TrainState` holding ``d``'s tensors.

        Raises:
            ValueError: ``d`` is not a TrainState state dict.

        Example:
            >>> s = fmp.TrainState.create({"w": torch.ones(2)}, fmp.optim.adam())
            >>> int(fmp.TrainState.from_state_dict(s.state_dict()).step)
            0
        """
        from fmp.checkpoint import from_state_dict

        return from_state_dict(d)


# pickles (torch.save of a state, checkpoints) name the class where users import it from
TrainState.__module__ = "fmp.step"
