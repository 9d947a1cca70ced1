"""The README's commands and its API tour stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_two_commands_near_the_top_and_ci_runs_the_test_one():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert blocks[0].endswith("python -m fmp.demo --device auto")
    assert blocks[1].endswith("python -m pytest")
    assert README.index(blocks[1]) < README.index("## A tour")
    assert "python -m pytest\n" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_api_tour_runs():
    code = re.search(r"## A tour.*?```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
