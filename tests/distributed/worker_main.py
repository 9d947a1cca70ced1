"""The 2-rank scenarios of the distributed tests: ``worker_main.py [fast|slow]``.

``fast`` (the default) runs every cheap scenario in one launch (process start-up dominates
on CPU); ``slow`` runs the torch.compile one on its own, so ``-m "not slow"`` skips it.
"""

import sys

import worker_apex
import worker_ddp
import worker_fsdp
from dist_worker import run

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "fast"
    run(worker_ddp.SLOW_SCENARIOS if which == "slow"
        else {**worker_ddp.SCENARIOS, **worker_fsdp.SCENARIOS, **worker_apex.SCENARIOS})
