"""fmp: functional mixed precision for PyTorch."""

from fmp.dtypes import dtype
from fmp.functional import functional
from fmp.policy import PRESETS, Policy, cast_params, get_policy, module_policies
from fmp.tree import all_finite, cast_tree, select_tree

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Policy",
    "all_finite",
    "cast_params",
    "cast_tree",
    "dtype",
    "functional",
    "get_policy",
    "module_policies",
    "select_tree",
]
