"""Every Example in the docstrings of the Apex extras (parallel, optimizers, fp16_utils,
amp_C, multi_tensor_apply) runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

MODULES = ["adapters.apex.amp_C", "adapters.apex.multi_tensor_apply", "adapters.apex._warn",
           "adapters.apex.optimizers", "adapters.apex.optimizers._common",
           "adapters.apex.optimizers._subset",
           "adapters.apex.optimizers._fused_adam", "adapters.apex.optimizers._fused_sgd",
           "adapters.apex.optimizers._fused_lamb", "adapters.apex.optimizers._fused_novograd",
           "adapters.apex.fp16_utils", "adapters.apex.fp16_utils._fp16util",
           "adapters.apex.fp16_utils._loss_scaler", "adapters.apex.fp16_utils._fp16_optimizer",
           "adapters.apex.parallel", "adapters.apex.parallel.distributed",
           "adapters.apex.parallel.LARC", "adapters.apex.parallel.sync_batchnorm"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, extraglobs={**vars(mod), "torch": torch}, report=True)
    assert result.failed == 0
    assert result.attempted > 0
