"""Adapter tests: tiny tensors, so one intra-op thread (restored after each test).

With tensors this small, OpenMP worker threads only spin-wait, and on a loaded machine
they make the suite many times slower.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

