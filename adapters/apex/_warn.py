"""One wording for the warnings of Apex arguments that torch has no equivalent of."""

from __future__ import annotations

import warnings
from typing import Any


class ApexArgumentWarning(UserWarning):
    """An Apex argument was accepted but has no torch equivalent; the message says what
    happens instead.

    Example:
        >>> issubclass(ApexArgumentWarning, UserWarning)
        True
    """


def warn_unsupported(owner: str, arg: str, value: Any, instead: str, stacklevel: int = 3) -> None:
    """Warn that ``owner``'s ``arg=value`` has no torch equivalent, and what happens instead.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn_unsupported("FusedAdam", "master_weights", True, "ignored")
        >>> str(w[0].message)
        'FusedAdam: master_weights=True has no torch equivalent; ignored'
    """
    warnings.warn(f"{owner}: {arg}={value!r} has no torch equivalent; {instead}",
                  ApexArgumentWarning, stacklevel=stacklevel)
