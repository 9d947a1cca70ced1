"""``fmp.float8.convert`` (a model's ``nn.Linear`` layers to float8) and ``fmp.float8.init``
(their records for ``TrainState.float8``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fmp.float8._linear import Float8Linear, check_device
from fmp.float8._recipe import Recipe, as_recipe
from fmp.float8._scales import Float8LinearScales

Predicate = Callable[[str, torch.nn.Module], bool]


def _eligible(m: torch.nn.Module) -> bool:
    return (type(m) is torch.nn.Linear and m.in_features % 16 == 0
            and m.out_features % 16 == 0)


def convert(model: torch.nn.Module, recipe: Recipe | str = "dynamic",
            modules: Predicate | None = None) -> torch.nn.Module:
    """Turn the model's eligible ``nn.Linear`` layers into :class:`Float8Linear`, in place.

    Eligible: exactly ``nn.Linear`` (not a subclass: ``nn.MultiheadAttention``'s projection
    is read by its owner, not called) with both sizes multiples of 16, and chosen by
    ``modules``. A converted layer keeps its parameter objects (names, tied weights and
    optimizers that hold them are unchanged) and gets its qualified name.

    Args:
        model: the model.
        recipe: a :class:`fmp.float8.Recipe`, or ``"dynamic"`` / ``"delayed"``.
        modules: None (every eligible layer) or ``predicate(qualified_name, module) ->
            bool``.

    Returns:
        ``model`` (converted in place).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``recipe`` is neither a Recipe nor
            a string; ``modules`` is not callable.
        ValueError: a bad recipe (the message names the field).
        RuntimeError: the model is on a GPU without float8 matmuls (capability < 8.9).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3))
        >>> net = fmp.float8.convert(net, "delayed")
        >>> [type(m).__name__ for m in net]
        ['Float8Linear', 'Linear']
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fmp.float8.convert needs a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if modules is not None and not callable(modules):
        raise TypeError(f"modules must be None or a predicate (name, module) -> bool, got "
                        f"{type(modules).__name__}")
    recipe = as_recipe(recipe)
    chosen = [(n, m) for n, m in model.named_modules()
              if _eligible(m) and (modules is None or modules(n, m))]
    for _, m in chosen:
        check_device(m.weight.device)
    for n, m in chosen:
        Float8Linear.from_linear(m, recipe, n)
    return model


def init(model: torch.nn.Module) -> dict[str, Float8LinearScales]:
    """The float8 records of a converted model, for ``TrainState.create(..., float8=)``.

    One :class:`Float8LinearScales` per :class:`Float8Linear`, keyed by its qualified name
    in ``model`` (which the layer is told, so the step finds its record), on its weight's
    device, with the layer's recipe.

    Args:
        model: a model with Float8Linear layers (:func:`convert`).

    Returns:
        ``{qualified name: record}``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no Float8Linear layer.

    Example:
        >>> net = fmp.float8.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), "delayed")
        >>> sorted(fmp.float8.init(net))
        ['0']
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fmp.float8.init needs a torch.nn.Module, got {type(model).__name__}")
    out: dict[str, Float8LinearScales] = {}
    for n, m in model.named_modules():
        if isinstance(m, Float8Linear):
            m.float8_name = n
            out[n] = Float8LinearScales.create(m.recipe, device=m.weight.device)
    if not out:
        raise ValueError("fmp.float8.init: the model has no Float8Linear layer; convert it "
                         "first with fmp.float8.convert(model, recipe)")
    return out


def check_records(float8: Any) -> dict[str, Float8LinearScales]:
    """``float8`` as ``TrainState.float8`` holds it: a dict of str to records.

    Raises:
        TypeError: anything else (the message names the bad entry).
    """
    if not isinstance(float8, dict):
        raise TypeError(f"float8 must be a dict from fmp.float8.init(model), got "
                        f"{type(float8).__name__}")
    for k, v in float8.items():
        if not isinstance(k, str) or not isinstance(v, Float8LinearScales):
            raise TypeError(f"float8 must map qualified names to fmp.float8."
                            f"Float8LinearScales; the entry {k!r} is {type(v).__name__}")
    return float8
