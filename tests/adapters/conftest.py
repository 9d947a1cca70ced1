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


@pytest.fixture(autouse=True)
def _no_o1_mode_left():
    # [amp14a] the O1 casts of an initialize stay installed (as Apex's patches did):
    # remove them after each test so that tests do not see each other's
    yield
    from adapters.apex.amp import _o1_install

    _o1_install.uninstall()
