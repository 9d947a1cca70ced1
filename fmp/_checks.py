"""Argument checks shared by the step builders: a clear error instead of an internal one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_param_policies(param_policies: Any, fn: str) -> None:
    """``param_policies`` must be None or a mapping from parameter name to ``fmp.Policy``.

    Raises:
        TypeError: it is another container (a list, a tuple), or a key is not a str, or a
            value is not a Policy (a spec string such as ``"bf16-mixed"`` included: the
            message says to use :func:`fmp.get_policy` or :func:`fmp.module_policies`).
    """
    from fmp.policy import Policy

    if param_policies is None:
        return
    if not isinstance(param_policies, Mapping):
        raise TypeError(
            f"{fn}: param_policies must be a dict from parameter name to fmp.Policy (e.g. "
            f"fmp.module_policies(model, 'bf16-mixed')), got a {type(param_policies).__name__}"
        )
    for k, v in param_policies.items():
        if not isinstance(k, str):
            raise TypeError(f"{fn}: param_policies keys must be parameter names (str), got "
                            f"{k!r} ({type(k).__name__})")
        if not isinstance(v, Policy):
            hint = (f"; for a spec use fmp.get_policy({v!r})" if isinstance(v, str) else "")
            raise TypeError(
                f"{fn}: param_policies[{k!r}] is a {type(v).__name__} ({v!r}), not an "
                f"fmp.Policy{hint} (fmp.module_policies builds the whole dict)"
            )


def check_loss_scale(loss_scale: Any, fn: str) -> None:
    """``loss_scale`` must be an fmp loss-scale record (``scale``, ``unscale_and_check``).

    Raises:
        TypeError: it is None, a number, or another object; the message names it.
    """
    if hasattr(loss_scale, "scale") and hasattr(loss_scale, "unscale_and_check"):
        return
    hint = (f"; for a fixed scale pass fmp.StaticLossScale({loss_scale!r})"
            if isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool)
            else "")
    raise TypeError(
        f"{fn}: loss_scale must be an fmp loss-scale record (fmp.NoOpLossScale(), "
        f"fmp.StaticLossScale(s), fmp.DynamicLossScale.create()), got "
        f"{type(loss_scale).__name__} {loss_scale!r}{hint}"
    )
