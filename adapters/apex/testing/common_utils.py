"""``apex.testing.common_utils``: Apex's test helpers (``TEST_WITH_ROCM``, ``skipIfRocm``).

Example:
    >>> from adapters.apex.testing.common_utils import skipIfRocm
    >>> @skipIfRocm
    ... def f():
    ...     return 1
    >>> f()
    1
"""

from __future__ import annotations

import functools
import os
import unittest
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TEST_WITH_ROCM", "skipIfRocm"]

#: True when the tests are asked to run as on ROCm (Apex's ``APEX_TEST_WITH_ROCM=1``) or
#: torch is a ROCm build.
TEST_WITH_ROCM: bool = (os.getenv("APEX_TEST_WITH_ROCM", "0") == "1"
                        or getattr(torch.version, "hip", None) is not None)


def skipIfRocm(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a test to be skipped (``unittest.SkipTest``) on ROCm.

    Args:
        fn: the test function.

    Returns:
        A wrapper that runs ``fn`` (and returns its result) unless :data:`TEST_WITH_ROCM`.

    Raises:
        unittest.SkipTest: when called under ROCm.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if TEST_WITH_ROCM:
            raise unittest.SkipTest("test doesn't currently work on ROCm")
        return fn(*args, **kwargs)
    return wrapper
