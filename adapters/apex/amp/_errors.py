"""The one exception type of the Apex adapter."""

from __future__ import annotations


class AmpError(RuntimeError, ValueError):
    """A misuse of the Apex amp interface (bad arguments, wrong call order).

    It is both a ``RuntimeError`` (what Apex raised, so legacy ``except RuntimeError``
    clauses keep working) and a ``ValueError`` (fmp's convention for bad values).

    Example:
        >>> from adapters.apex.amp import Amp, AmpError
        >>> try:
        ...     Amp().initialize(torch.nn.Linear(2, 2), opt_level="O9")
        ... except AmpError as e:
        ...     print(str(e).split(";")[0])
        unknown opt_level 'O9'
    """
