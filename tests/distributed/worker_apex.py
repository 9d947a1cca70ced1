"""Rank side of test_apex_distributed.py: ``adapters.apex`` under DDP and FSDP2 (gloo, CPU).

DDP: ``amp.initialize`` first, then ``DistributedDataParallel`` (Apex's order), at O1 and
O2 in float16. Two kinds of one-rank overflow, at chosen steps:

- ``BACKWARD``: an inf in rank 1's backward (through the activations); DDP's all-reduce
  spreads it, so every rank sees it without any help;
- ``GRAD``: an inf written into one grad on rank 1 *after* DDP's reduction, inside the
  ``scale_loss`` context; only ``Amp(process_group=...)`` makes the other rank agree.

Checkpoints: rank 0 saves model, optimizer and amp state mid-way; every rank resumes from
that file into fresh objects (loaded before or after initialize) and must end bit for bit
where the uninterrupted run ends.

FSDP2: ``fully_shard`` then the optimizer then ``initialize`` at O1; an inf in rank 1's
grad shard only must make both ranks skip.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import ScaleGrad, blobs, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import fmp
from adapters.apex.amp import Amp, AmpError

STEPS = 6
BACKWARD = (1,)  # steps with an inf in rank 1's backward (spread by DDP)
GRAD = (4,)  # steps with an inf written into a grad of rank 1 after DDP's reduction
RESUME_AT = 3  # the checkpoint is taken after this many steps
HIDDEN = 16
WINDOW = 2  # scale_window: the scale moves both ways within a few steps


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_across_ranks(model: torch.nn.Module) -> bool:
    """all_gather every param's bits and compare them with rank 0's."""
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return all(torch.equal(g, got[0]) for g in got)


class _Run:
    """One DDP training set-up: model, optimizer, Amp, DDP wrapper, data, injection."""

    def __init__(self, rank: int, world: int, opt_level: str, group: str | None,
                 state: dict | None = None, load: str = "after") -> None:
        self.rank = rank
        model = mlp(hidden=HIDDEN, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        self.amp = Amp(scale_window=WINDOW, process_group=group)
        if state is not None and load == "before":
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            self.amp.load_state_dict(state["amp"])
        model, opt = self.amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
        self.factor = torch.ones(())
        model[1].register_forward_hook(lambda m, i, o: ScaleGrad.apply(o, self.factor))
        self.ddp = DDP(model)  # wrap after initialize
        if state is not None and load == "after":
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            self.amp.load_state_dict(state["amp"])
        self.model, self.opt = model, opt
        x, y = blobs(64)
        self.x, self.y = x.chunk(world)[rank], y.chunk(world)[rank]

    def step(self, i: int) -> dict:
        bad_backward = self.rank == 1 and i in BACKWARD
        self.factor = torch.tensor(float("inf") if bad_backward else 1.0)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.ddp(self.x), self.y)
        with self.amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
            if self.rank == 1 and i in GRAD:
                with torch.no_grad():
                    self.model[0].weight.grad[0, 0] = float("inf")
        self.opt.step()
        return {"loss": loss.item(), "skipped": self.amp.last_step_skipped(),
                "loss_scale": self.amp.loss_scale(), "params": _params(self.model)}

    def checkpoint(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "amp": self.amp.state_dict()}


def _ddp(rank: int, world: int, opt_level: str) -> dict:
    full = _Run(rank, world, opt_level, "default")
    trace = []
    for i in range(STEPS):
        trace.append(full.step(i))
        if i + 1 == RESUME_AT and rank == 0:
            torch.save(full.checkpoint(), _ckpt(opt_level))
    out = {"trace": trace, "same": _same_across_ranks(full.model),
           "amp": dict(full.amp.state_dict()), "model_dtype": full.model[0].weight.dtype,
           "state_dict_dtype": full.model.state_dict()["0.weight"].dtype,
           "master_dtype": full.opt.param_groups[0]["params"][0].dtype}
    dist.barrier()  # the checkpoint is on disk
    for load in ("before", "after"):
        state = torch.load(_ckpt(opt_level), weights_only=True)  # every rank reads rank 0's
        run = _Run(rank, world, opt_level, "default", state, load)
        resumed = [run.step(i) for i in range(RESUME_AT, STEPS)]
        out[f"resumed_{load}"] = {"trace": resumed, "same": _same_across_ranks(run.model),
                                  "amp": dict(run.amp.state_dict())}
    # the control: without process_group, an inf written after DDP's reduction on rank 1
    # only makes rank 1 alone skip (the replicas part)
    lone = _Run(rank, world, opt_level, None)
    out["no_group"] = [lone.step(i)["skipped"] for i in range(GRAD[0] + 1)]
    out["no_group_same"] = _same_across_ranks(lone.model)
    return out


def _ckpt(opt_level: str) -> str:
    return os.path.join(os.environ["FMP_DIST_OUT"], f"apex_{opt_level}.pt")


def apex_ddp_o1(rank: int, world: int) -> dict:
    return _ddp(rank, world, "O1")


def apex_ddp_o2(rank: int, world: int) -> dict:
    return _ddp(rank, world, "O2")


FSDP_STEPS = 5
FSDP_INJECT = (1, 3)  # steps with an inf in rank 1's shard of the first weight's grad


def apex_fsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = mlp(hidden=HIDDEN, seed=0)
    mesh = init_device_mesh("cpu", (world,))  # explicit: the default mesh follows CUDA
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    errors = {}
    try:
        Amp().initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         opt_level="O2", verbosity=0)
    except AmpError as e:
        errors["O2"] = str(e)
    amp = Amp(scale_window=100)  # no process_group: the sharded grads are detected
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = blobs(64)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    trace = []
    for i in range(FSDP_STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            w = model[0].weight.grad
            if rank == 1 and i in FSDP_INJECT:
                with torch.no_grad():
                    w.to_local()[0, 0] = float("inf")
            local_ok = bool(fmp.all_finite([p.grad.to_local() for p in model.parameters()]))
        opt.step()
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        trace.append({"loss": loss.item(), "skipped": amp.last_step_skipped(),
                      "local_ok": local_ok, "loss_scale": amp.loss_scale(), "params": full})
    return {"trace": trace, "errors": errors, "grad": (type(w).__name__, w.dtype)}


SCENARIOS = {"apex_ddp_o1": apex_ddp_o1, "apex_ddp_o2": apex_ddp_o2, "apex_fsdp": apex_fsdp}
