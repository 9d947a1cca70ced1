"""What a train step learns from the module behind :func:`fmp.functional`.

A train step sees only a params dict; the module it came from knows which params are
frozen, which belong to norm layers and which buffers its forward updates. Two channels
carry that knowledge:

- modules given to :func:`fmp.functional` are registered (weakly); a step with a plain
  mixed policy finds the module whose parameter names and shapes match its params and
  keeps that module's norm layers in float32 (:func:`default_param_policies`);
- while a step runs ``loss_fn`` it publishes its policy in :data:`ACTIVE`, so the
  ``apply_fn`` called inside casts the frozen params it supplies itself as the step casts
  the trainable ones, and refuses buffer updates a skipped step could not undo.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fmp.policy import Policy, keeps_norms_fp32, module_policies, norm_policy

_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, None] = weakref.WeakKeyDictionary()


def register(model: torch.nn.Module) -> None:
    """Remember ``model`` (weakly) for :func:`default_param_policies`."""
    _MODELS[model] = None


def default_param_policies(params: Any, pol: Policy) -> dict[str, Policy] | None:
    """Per-param policies for a step given a plain ``pol``: norm layers in float32.

    Only for mixed policies with float32 params (the mixed presets) and params dicts that
    match, by names and shapes, a module given to :func:`fmp.functional`. None where no
    rule applies (every param takes ``pol``).

    Raises:
        ValueError: several live modules match with different norm layers.
    """
    if not keeps_norms_fp32(pol) or not isinstance(params, Mapping) or not params:
        return None
    found: dict[frozenset[str], dict[str, Policy]] = {}
    for model in list(_MODELS):
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if not all(k in shapes and isinstance(v, torch.Tensor) and tuple(v.shape) == shapes[k]
                   for k, v in params.items()):
            continue
        pols = module_policies(model, pol)
        chosen = {k: pols[k] for k in params}
        found[frozenset(k for k, q in chosen.items() if q != pol)] = chosen
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            "fmp.train_step: the params match several modules given to fmp.functional, "
            "with different norm layers; pass param_policies=fmp.module_policies(model, "
            "policy) to say which")
    (norms, chosen), = found.items()
    return chosen if norms else None


class Active:
    """The running step's casts, published while it calls ``loss_fn``.

    Attributes:
        policy: the step's policy, or None outside a step.
        param_policies: its per-param policies (given or found), or None.
        skip_safe: True inside :func:`fmp.train_step` (which must be able to undo a step).
    """

    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.param_policies: Mapping[str, Policy] | None = None
        self.skip_safe = False

    def compute_dtype(self, name: str, is_norm: bool) -> torch.dtype | None:
        """The compute dtype for a param ``name`` the step does not cast itself."""
        if self.policy is None:
            return None
        pp = self.param_policies
        if pp is not None and name in pp:
            return pp[name].compute_dtype
        if is_norm:
            q = norm_policy(self.policy)
            if q is not None:
                return q.compute_dtype
        return self.policy.compute_dtype


#: the running step's casts (a single slot: steps do not nest their loss calls)
ACTIVE = Active()
