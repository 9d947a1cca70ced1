"""Rank side of test_checkpoint_fsdp.py: a TrainState with FSDP2-sharded params saved and
loaded through torch.distributed.checkpoint (DCP) on 2 CPU ranks with gloo.

The state's params are the DTensor shards of ``fully_shard``; its Adam moments are DTensors
of the same sharding (``optimizer.init`` of the shards). It is updated twice, saved with
``dcp.save({"train": state.state_dict()})``, then loaded in place into a fresh state of
other values and other loss-scale hyper-parameters, as FSDP2 users load their checkpoints.
Run on its own: ``python worker_checkpoint.py`` under dist_launch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from helpers import mlp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fmp
import fmp.distributed as fd
from fmp import optim

HIDDEN = 32


def _sharded_state(world: int, seed: int, ls: fmp.DynamicLossScale
                   ) -> tuple[fmp.TrainState, optim.GradientTransformation]:
    model = mlp(hidden=HIDDEN, seed=seed)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    params = {n: p.detach() for n, p in model.named_parameters()}
    opt = optim.adamw(1e-2, weight_decay=0.1)
    return fmp.TrainState.create(params, opt, ls), opt


def _update(state: fmp.TrainState, opt: optim.GradientTransformation, i: int
            ) -> fmp.TrainState:
    """One optimizer update with deterministic grads (a function of the params and i)."""
    grads = {k: torch.sin(v * (i + 1.0)) * 0.1 for k, v in state.params.items()}
    finite = fd.all_finite(grads)  # checked by shard, agreed across ranks
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return state._replace(params=optim.apply_updates(state.params, updates),
                          opt_state=opt_state, step=state.step + 1,
                          loss_scale=state.loss_scale.adjust(finite))


def _local(state: fmp.TrainState) -> dict:
    """This rank's shards (plain tensors) of the params, moments and counters."""
    import optree

    def loc(x):
        return (x.to_local().clone() if isinstance(x, DTensor)
                else x.clone() if isinstance(x, torch.Tensor) else x)

    return {f: optree.tree_map(loc, getattr(state, f), none_is_leaf=True)
            for f in ("params", "opt_state", "step", "skipped_total")}


def fsdp_dcp(rank: int, world: int) -> dict:
    path = os.path.join(os.environ["FMP_DIST_OUT"], "dcp")
    state, opt = _sharded_state(world, 0, fmp.DynamicLossScale.create(
        initial=2.0**10, period=2, hysteresis=3))
    for i in range(2):
        state = _update(state, opt, i)
    dcp.save({"train": state.state_dict()}, checkpoint_id=path)
    saved = _local(state)
    saved_ls = state.loss_scale.state_dict()
    cont = state
    for i in range(2, 4):
        cont = _update(cont, opt, i)

    fresh, opt2 = _sharded_state(world, 1, fmp.DynamicLossScale.create())  # other values
    before = _local(fresh)
    sd = {"train": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    loaded = fmp.TrainState.from_state_dict(sd["train"])
    p0 = loaded.params["0.weight"]
    resumed = loaded
    for i in range(2, 4):
        resumed = _update(resumed, opt2, i)
    return {
        "fresh_differed": not torch.equal(before["params"]["0.weight"],
                                          saved["params"]["0.weight"]),
        "saved": saved, "saved_ls": saved_ls,
        "loaded": _local(loaded),
        "loaded_ls": loaded.loss_scale.state_dict(),
        "param": (type(p0).__name__, str(p0.placements), tuple(p0.shape),
                  tuple(p0.to_local().shape)),
        "moment": type(loaded.opt_state.mu["0.weight"]).__name__,
        "cont": _local(cont),
        "resumed": _local(resumed),
    }


SCENARIOS = {"fsdp_dcp": fsdp_dcp}

if __name__ == "__main__":
    from dist_worker import run

    run(SCENARIOS, timeout_s=60.0)
