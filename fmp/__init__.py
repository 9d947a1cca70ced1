"""fmp: functional mixed precision for PyTorch.

Pure functions over parameter pytrees (optree) on torch.func: dtype policies, loss-scale
records, functional optimizers (``fmp.optim``) and a skip-safe train step with no host sync.
"""

from fmp import checkpoint, distributed, float8, optim
from fmp._compile import CompiledStep, compile, inductor_workarounds
from fmp._step_type import GradReducer, TrainStep
from fmp.cuda_graph import GraphedStep, cuda_graph
from fmp.dtypes import DTYPE_NAMES, dtype, dtype_name, is_floating
from fmp.functional import functional
from fmp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_from_state_dict,
)
from fmp.policy import NORM_LAYERS, PRESETS, Policy, cast_params, get_policy, module_policies
from fmp.step import TrainState, value_and_grad
from fmp.train import train_step
from fmp.tree import all_finite, cast_tree, copy_tree_, floating_leaves, select_tree

checkpoint.register_safe_globals()

__version__ = "0.1.0"

__all__ = [
    "DTYPE_NAMES",
    "NORM_LAYERS",
    "PRESETS",
    "CompiledStep",
    "DynamicLossScale",
    "GradReducer",
    "GraphedStep",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "TrainState",
    "TrainStep",
    "all_finite",
    "cast_params",
    "cast_tree",
    "checkpoint",
    "compile",
    "copy_tree_",
    "cuda_graph",
    "distributed",
    "dtype",
    "dtype_name",
    "float8",
    "floating_leaves",
    "functional",
    "get_policy",
    "inductor_workarounds",
    "is_floating",
    "loss_scale_from_state_dict",
    "module_policies",
    "optim",
    "select_tree",
    "train_step",
    "value_and_grad",
]
