"""Rank side of test_apex_parallel_distributed.py: ``adapters.apex.parallel`` on 2 gloo
CPU ranks: SyncBatchNorm, DistributedDataParallel (arguments, and under amp O1/O2 next
to torch's DDP), Reducer, create_syncbn_process_group, and the ImageNet-style script."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_worker import run
from helpers import ScaleGrad, blobs, mlp
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from adapters.apex.amp import Amp
from adapters.apex.parallel import (
    DistributedDataParallel,
    Reducer,
    convert_syncbn_model,
    create_syncbn_process_group,
)

STEPS = 5
INJECT = (1,)  # steps with an inf in rank 1's backward
SYNCBN_N = 8


def syncbn_inputs():
    """The full batch, the output weights and the batch norm both sides start from."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SYNCBN_N, 3, 4, 4, generator=g) * 2 + 1
    w = torch.randn(SYNCBN_N, 3, 4, 4, generator=g)
    bn = torch.nn.BatchNorm2d(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
        bn.bias.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    return x, w, bn


def syncbn(rank: int, world: int) -> dict:
    x, w, bn = syncbn_inputs()
    sbn = convert_syncbn_model(copy.deepcopy(bn))
    out = []
    for k in range(2):  # twice: the running statistics move twice
        xs = (x + k).chunk(world)[rank].clone().requires_grad_()
        y = sbn(xs)
        sbn.zero_grad()
        (y * w.chunk(world)[rank]).sum().backward()
        out.append({"y": y.detach(), "x_grad": xs.grad, "w_grad": sbn.weight.grad.clone(),
                    "b_grad": sbn.bias.grad.clone()})
    sbn.eval()
    return {"steps": out, "running_mean": sbn.running_mean.clone(),
            "running_var": sbn.running_var.clone(), "tracked": int(sbn.num_batches_tracked),
            "eval": sbn(x.chunk(world)[rank]).detach(), "type": type(sbn).__mro__[1].__name__}


def _train(rank: int, world: int, level: str, wrapper) -> list[dict]:
    model = mlp(hidden=16, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    amp = Amp(scale_window=2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    factor = {"f": torch.ones(())}
    model[1].register_forward_hook(lambda m, i, o: ScaleGrad.apply(o, factor["f"]))
    net = wrapper(model)
    x, y = blobs(64)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    trace = []
    for i in range(STEPS):
        factor["f"] = torch.tensor(float("inf") if rank == 1 and i in INJECT else 1.0)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        trace.append({"skipped": amp.last_step_skipped(), "loss_scale": amp.loss_scale(),
                      "params": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return trace


def ddp_amp(rank: int, world: int) -> dict:
    out = {}
    for level in ("O1", "O2"):
        out[level] = {"apex": _train(rank, world, level, DistributedDataParallel),
                      "torch": _train(rank, world, level, TorchDDP),
                      "fp32": _train(rank, world, level, lambda m: DistributedDataParallel(
                          m, allreduce_always_fp32=True, gradient_predivide_factor=2.0))}
    return out


def _grad_of(rank: int, make, dtype=torch.float32) -> torch.Tensor:
    lin = torch.nn.Linear(4, 1, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    net = make(lin)
    net(torch.full((1, 4), rank + 1.0, dtype=dtype)).sum().backward()
    return lin.weight.grad[0, 0].item()  # rank 0's grad is 1, rank 1's is 2


def ddp_options(rank: int, world: int) -> dict:
    D = DistributedDataParallel
    grads = {
        "default": _grad_of(rank, D),
        "no_average": _grad_of(rank, lambda m: D(m, gradient_average=False)),
        "predivide": _grad_of(rank, lambda m: D(m, gradient_predivide_factor=4.0)),
        "predivide_no_average": _grad_of(rank, lambda m: D(m, gradient_predivide_factor=4.0,
                                                           gradient_average=False)),
        "delay": _grad_of(rank, lambda m: D(m, delay_allreduce=True)),
        "small_buckets": _grad_of(rank, lambda m: D(m, message_size=1)),
        "fp16_in_fp32": _grad_of(rank, lambda m: D(m, allreduce_always_fp32=True),
                                 torch.float16),
    }
    lin = torch.nn.Linear(4, 1, bias=False)
    net = D(lin)
    net.disable_allreduce()
    net(torch.full((1, 4), rank + 1.0)).sum().backward()
    grads["disabled"] = lin.weight.grad[0, 0].item()
    net.enable_allreduce()
    lin.weight.grad = None
    net(torch.full((1, 4), rank + 1.0)).sum().backward()
    grads["enabled_again"] = lin.weight.grad[0, 0].item()
    # Reducer: a module (params broadcast from rank 0) or a list of grads
    lin = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(float(rank))
    red = Reducer(lin)
    grads["reducer_broadcast"] = lin.weight[0, 0].item()
    lin(torch.full((1, 4), rank + 1.0)).sum().backward()
    red.reduce()
    grads["reducer"] = lin.weight.grad[0, 0].item()
    g = [torch.full((3,), rank + 1.0)]
    Reducer(g).reduce()
    grads["reducer_list"] = g[0].tolist()
    errors, messages = {}, {}
    try:
        D(torch.nn.Linear(2, 1), shared_param=True)
    except ValueError as e:
        errors["shared_param"] = str(e)
    for name, kw in {"retain_allreduce_buffers": {"retain_allreduce_buffers": True},
                     "allreduce_trigger_params": {"allreduce_trigger_params": []},
                     "num_allreduce_streams": {"num_allreduce_streams": 2},
                     "prof": {"prof": True},
                     "split": {"gradient_average_split_factor": 4.0}}.items():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            net = D(torch.nn.Linear(2, 1), **kw)
        messages[name] = [str(x.message) for x in w]
        if name == "split":
            grads["split_factor"] = net.gradient_predivide_factor
    groups = {size: dist.get_world_size(create_syncbn_process_group(size)) for size in (1, 2)}
    try:
        create_syncbn_process_group(3)
    except ValueError as e:
        errors["group_size"] = str(e)
    return {"grads": grads, "errors": errors, "warnings": messages, "groups": groups}


SCENARIOS = {"syncbn": syncbn, "ddp_amp": ddp_amp, "ddp_options": ddp_options}

if __name__ == "__main__":
    run(SCENARIOS)
