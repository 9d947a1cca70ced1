"""2-rank gloo launches shared by the tests (start-up dominates on CPU): one for the cheap
scenarios, one for the slow (torch.compile) one, each started only if a test needs it."""

import pytest
from dist_launch import run_ranks


def _getter(ranks):
    def get(name):
        out = [r[name] for r in ranks]
        for rank, o in enumerate(out):
            assert not (isinstance(o, dict) and "error" in o), f"rank {rank}:\n{o['error']}"
        return out

    return get


@pytest.fixture(scope="session")
def _fast_ranks():
    return run_ranks("worker_main.py", "fast", timeout=150)


@pytest.fixture(scope="session")
def _slow_ranks():
    return run_ranks("worker_main.py", "slow", timeout=240)


@pytest.fixture
def result(_fast_ranks):
    """``result(name)`` -> [rank 0's, rank 1's] result of a scenario; fails on its error."""
    return _getter(_fast_ranks)


@pytest.fixture
def slow_result(_slow_ranks):
    """As ``result``, for the scenarios of the slow launch."""
    return _getter(_slow_ranks)
