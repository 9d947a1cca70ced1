"""``python -m fmp.demo``: fmp's mixed-precision policies side by side on real data.

A small CNN learns scikit-learn's handwritten digits (shipped inside the package, nothing
is downloaded) under fp32, bf16-mixed and fp16-mixed through :func:`fmp.train_step`, and
under Apex's O1 and O2 through the adapter (``from adapters import apex``). Needs the
``demo`` extra: ``pip install -e ".[demo]"``.

Modules: :mod:`~fmp.demo.data` (the split), :mod:`~fmp.demo.model` (the CNN),
:mod:`~fmp.demo.run` (training one policy), :mod:`~fmp.demo.legacy` (the Apex-style
loop), :mod:`~fmp.demo.report` (table, figure, JSON), :mod:`~fmp.demo.cli` (flags).

Example:
    >>> from fmp.demo import main
    >>> main(["--steps", "50", "--policies", "fp32,bf16-mixed"])  # doctest: +SKIP
"""

from fmp.demo.cli import main

__all__ = ["main"]
