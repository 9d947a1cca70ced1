"""Rank side of test_apex_masters_ddp.py: O2 masters follow DDP's broadcast (issue 14).

Each rank builds its model from its own seed, as scripts that seed by rank do; DDP's
constructor then broadcasts rank 0's weights. Apex made the float32 masters lazily, after
that broadcast; here they exist from initialize on and must take the broadcast values, or
the first step writes each rank's own initial weights back and the replicas part.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_worker import run
from helpers import blobs, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

from adapters.apex.amp import Amp

STEPS = 3


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return got


def masters_follow_broadcast(rank: int, world: int) -> dict:
    model = mlp(hidden=16, seed=rank)  # a different init on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    amp = Amp()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model)
    x, y = blobs(64)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    same = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        params = _bits(list(model.parameters()))
        masters = _bits(list(amp.master_params(opt)))
        same.append((all(torch.equal(g, params[0]) for g in params),
                     all(torch.equal(g, masters[0]) for g in masters)))
    return {"same": same, "loss": loss.item()}


SCENARIOS = {"masters_follow_broadcast": masters_follow_broadcast}

if __name__ == "__main__":
    run(SCENARIOS)
    sys.exit(0)
