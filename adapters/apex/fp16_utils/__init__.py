"""``apex.fp16_utils``: Apex's manual float16 training helpers, rebuilt on torch.

:class:`FP16_Optimizer` (float32 masters, static or dynamic loss scale,
``optimizer.backward(loss)``, ``clip_master_grads``, ``state_dict``), the network
helpers (:func:`network_to_half`, :func:`convert_network`, :class:`FP16Model`,
:func:`BN_convert_float`), the master-param helpers (:func:`prep_param_lists`,
:func:`model_grads_to_master_grads`, :func:`master_params_to_model_params`),
:func:`to_python_float`, :func:`clip_grad_norm`, and the scalers.

Example:
    >>> from adapters.apex.fp16_utils import to_python_float
    >>> to_python_float(torch.tensor(1.5))
    1.5
"""

from adapters.apex.fp16_utils._fp16_optimizer import FP16_Optimizer
from adapters.apex.fp16_utils._fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from adapters.apex.fp16_utils._loss_scaler import AmpLossScaler, DynamicLossScaler, LossScaler

__all__ = ["AmpLossScaler", "BN_convert_float", "DynamicLossScaler", "FP16Model",
           "FP16_Optimizer", "LossScaler", "clip_grad_norm", "convert_module",
           "convert_network", "master_params_to_model_params", "model_grads_to_master_grads",
           "network_to_half", "prep_param_lists", "to_python_float", "tofp16"]
