"""fmp: functional mixed precision for PyTorch."""

from fmp.dtypes import dtype
from fmp.tree import all_finite, cast_tree, select_tree

__version__ = "0.1.0"

__all__ = [
    "all_finite",
    "cast_tree",
    "dtype",
    "select_tree",
]
