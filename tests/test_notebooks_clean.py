"""Committed notebooks carry no outputs: the suite executes them (nbmake), git stores sources.

Strip a notebook after running it by hand:

    python tests/test_notebooks_clean.py --fix
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = ["01_policies.ipynb", "02_loss_scaling.ipynb", "03_functional_train_step.ipynb",
            "04_legacy_apex_loop.ipynb"]


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def problems(nb: dict) -> list[str]:
    """What makes a notebook unclean: outputs, execution counts, widget state.

    Args:
        nb: the notebook's JSON.

    Returns:
        One message per offending cell or entry (empty when clean).
    """
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            found.append(f"cell {i} has {len(cell['outputs'])} output(s)")
        if cell.get("execution_count") is not None:
            found.append(f"cell {i} has execution_count {cell['execution_count']}")
    if "widgets" in nb.get("metadata", {}):
        found.append("metadata holds widget state")
    return found


def strip(nb: dict) -> dict:
    """The notebook with outputs, execution counts and widget state removed.

    Args:
        nb: the notebook's JSON (modified in place).

    Returns:
        ``nb``.
    """
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def test_the_notebooks_are_there():
    names = [p.name for p in _notebooks()]
    assert all(n in names for n in EXPECTED), names


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    found = problems(json.loads(path.read_text()))
    assert not found, (f"{path.name} is not stripped ({'; '.join(found)}); run "
                       f"`python tests/test_notebooks_clean.py --fix`")


def test_problems_and_strip_agree():
    dirty = {"cells": [{"cell_type": "code", "execution_count": 3, "outputs": [{"x": 1}]},
                       {"cell_type": "markdown", "source": "hi"}],
             "metadata": {"widgets": {}}}
    assert len(problems(dirty)) == 3
    assert problems(strip(dirty)) == []


if __name__ == "__main__":
    if sys.argv[1:] != ["--fix"]:
        sys.exit("usage: python tests/test_notebooks_clean.py --fix")
    for p in _notebooks():
        nb = json.loads(p.read_text())
        if problems(nb):
            p.write_text(json.dumps(strip(nb), indent=1, ensure_ascii=False) + "\n")
            print("stripped", p.name)
