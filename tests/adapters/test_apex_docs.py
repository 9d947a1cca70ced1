"""Every Example in the adapter's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

import fmp

MODULES = ["adapters.apex", "adapters.apex.amp", "adapters.apex.amp._amp",
           "adapters.apex.amp._errors", "adapters.apex.amp._opt_levels",
           "fmp.loss_scale._inplace", "adapters.apex.amp._log", "adapters.apex.amp._scaler",
           "adapters.apex.amp._master", "adapters.apex.amp._optimizer",
           "adapters.apex.amp._model", "adapters.apex.amp._casts",
           "adapters.apex.amp._initialize", "adapters.apex.amp._scale_loss",
           "adapters.apex.amp._checkpoint", "adapters.apex.amp._functions"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    globs = {**vars(mod), "torch": torch, "fmp": fmp}
    result = doctest.testmod(mod, extraglobs=globs, report=True)
    assert result.failed == 0
