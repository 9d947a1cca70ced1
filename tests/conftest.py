"""Shared pytest set-up: CUDA tests skip cleanly on machines without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_apex_casts_left():
    # An O1/O4 amp.initialize casts torch calls process-wide (as Apex's patches did): a test
    # that leaves them on (the demo's legacy run, say) must not change the tests after it.
    yield
    import sys

    amp = sys.modules.get("adapters.apex.amp")
    if amp is not None:
        amp.deactivate()
