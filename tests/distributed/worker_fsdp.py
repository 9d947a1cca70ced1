"""Rank side of test_fsdp.py: FSDP2 ``fully_shard`` on CPU/gloo with an fmp loss scale.

The inf is injected into one hidden unit's gradient on rank 1, so after the
reduce-scatter only the shard that holds that unit's row is non-finite: the ranks' local
verdicts disagree and only the all-reduced one (fmp.distributed.all_finite) is right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import ScaleGrad, blobs, mlp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fmp
import fmp.distributed as fd

STEPS = 5
INJECT = (1, 3)
HIDDEN = 32
BAD_UNIT = 24  # a row of the first layer's weight that lives in rank 1's shard (Shard(0))


def fsdp_skips(rank, world):
    torch.manual_seed(0)
    model = mlp(hidden=HIDDEN, seed=0)
    # an explicit CPU mesh: fully_shard's default mesh is CUDA's wherever CUDA is available
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh,
                    mp_policy=fd.fsdp_mixed_precision("bf16-mixed", root=False))
    fully_shard(model, mesh=mesh, mp_policy=fd.fsdp_mixed_precision("bf16-mixed"))
    factor = {"f": torch.ones(HIDDEN)}
    seen = {}

    def inject(mod, inp, out):
        return ScaleGrad.apply(out, factor["f"])

    def record(mod, inp, out):  # the GELU between the sharded layers
        seen.update(hidden=inp[0].dtype)

    model[1].register_forward_hook(inject)
    model[1].register_forward_hook(record)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ls = fmp.DynamicLossScale.create(initial=2.0**8, period=100)
    x, y = blobs(64)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    trace = []
    for i in range(STEPS):
        f = torch.ones(HIDDEN)
        if rank == 1 and i in INJECT:
            f[BAD_UNIT] = float("inf")
        factor["f"] = f
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        ls.scale(loss).backward()
        grads = [p.grad for p in model.parameters()]
        local = [g.to_local() for g in grads]
        local_ok = fmp.all_finite(local)
        ok = fd.all_finite(grads)  # DTensor leaves: checked by shard, verdict all-reduced
        with torch.no_grad():
            for g, u in zip(local, ls.unscale(local), strict=True):
                g.copy_(u)
        if ok:  # a host sync, as torch optimizers need
            opt.step()
        opt.zero_grad()
        ls = ls.adjust(ok)
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        trace.append({"loss": loss.detach(), "local_ok": bool(local_ok), "ok": bool(ok),
                      "loss_scale": ls.loss_scale.clone(), "params": full})
    p0 = next(iter(model.parameters()))
    return {"trace": trace, "hidden": seen["hidden"], "logits": logits.dtype,
            "param": (type(p0).__name__, p0.dtype, str(p0.placements)),
            "grad_dtype": grads[0].dtype}


SCENARIOS = {"fsdp_skips": fsdp_skips}
