"""Data-parallel training with the functional step: ``fmp.train_step(..., process_group=...)``.

Launch with torchrun (one process per GPU, or 2 CPU processes with gloo)::

    torchrun --nproc-per-node 2 benchmarks/ddp_train.py --backend gloo --steps 20 \\
        --inject-inf-rank 1 --inject-inf-step 3
    torchrun --nproc-per-node 2 benchmarks/ddp_train.py --backend nccl --model gpt \\
        --steps 50 --policy bf16-mixed          # GPT-2 small shape, tokens/s per rank
    torchrun --nproc-per-node 2 benchmarks/ddp_train.py --model gpt --tiny --steps 3

Each rank trains on its own shard of every global batch; grads are averaged across ranks
(bucketed all-reduce) and the finite verdict is agreed, so an inf injected on one rank
makes every rank skip that step. Each rank prints its loss and skips; at the end the
ranks compare a checksum of their params (identical bit for bit, or the run exits 1).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fmp
import fmp.distributed  # also before fmp/__init__ imports it


class PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (inf injects one)."""

    @staticmethod
    def forward(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (factor,) = ctx.saved_tensors
        return g * factor.to(g.dtype), None


def mlp(d_in: int = 16, hidden: int = 64, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, classes))


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A minimal GPT-2: token and position embeddings, blocks, final norm, tied head."""

    def __init__(self, vocab: int, seq: int, n_layer: int, n_head: int, d: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight",
                                                                      "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the head is tied to wte


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with CUDA, else gloo")
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--tiny", action="store_true", help="a small GPT (a CPU smoke test)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=None,
                   help="per rank (default: mlp 32, gpt 8, tiny gpt 4)")
    p.add_argument("--policy", default="bf16-mixed")
    p.add_argument("--loss-scale", choices=["dynamic", "none"], default="dynamic")
    p.add_argument("--lr", type=float, default=None, help="default: mlp 1e-2, gpt 6e-4")
    p.add_argument("--inject-inf-rank", type=int, default=-1)
    p.add_argument("--inject-inf-step", type=int, action="append", default=[],
                   help="a step (0-based) to poison on --inject-inf-rank; repeatable")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    p.add_argument("--log-every", type=int, default=None,
                   help="print every N steps (default: mlp 1, gpt 10; 0: only the last)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """-> (model, loss_fn(params, inputs, targets, factor), batch_fn(step) -> (x, y))."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial params on every rank
    if args.model == "mlp":
        model, bs = mlp(), args.batch_size or 32
        centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(args.seed)) * 2

        def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            # one global batch per step, split by rank: the same data as one process
            g = torch.Generator().manual_seed(args.seed * 100_003 + step)
            y = torch.randint(0, 4, (bs * world,), generator=g)
            x = centers[y] + torch.randn(bs * world, 16, generator=g)
            return x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
    else:
        vocab, seq, n_layer, n_head, d = ((256, 64, 2, 2, 64) if args.tiny
                                          else (50304, 1024, 12, 12, 768))
        model, bs = GPT(vocab, seq, n_layer, n_head, d), args.batch_size or (4 if args.tiny
                                                                            else 8)

        def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed((args.seed * 100_003 + step) * world + rank)
            tok = torch.randint(0, vocab, (bs, seq + 1), generator=g)
            return tok[:, :-1].to(device), tok[:, 1:].to(device)
    model = model.to(device)
    apply_fn, _, _ = fmp.functional(model)

    def loss_fn(params: Any, x: torch.Tensor, y: torch.Tensor, factor: torch.Tensor):
        logits = PoisonGrad.apply(apply_fn(params, x), factor)
        return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())

    return model, loss_fn, batch_fn


def say(line: str) -> None:
    """Print one whole line in one write (ranks share stdout under torchrun)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def params_digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2)
                                  // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, batch_fn = build(args, device)
    _, params, _ = fmp.functional(model)
    policy = fmp.get_policy(args.policy)
    params = policy.cast_to_param({k: v.clone() for k, v in params.items()})
    lr = args.lr or (1e-2 if args.model == "mlp" else 6e-4)
    opt = fmp.optim.adamw(lr, weight_decay=0.0)
    ls = fmp.DynamicLossScale.create() if args.loss_scale == "dynamic" else None
    state = fmp.TrainState.create(params, opt, ls)
    step = fmp.train_step(loss_fn, opt, policy, donate=True, process_group="default")
    if args.compile:
        step = fmp.compile(step, whole_graph=True)  # one graph; the donation copy first
    n_params = sum(p.numel() for p in params.values())
    if rank == 0:
        say(f"world {world} backend {backend} device {device.type} model {args.model}"
            f"{' (tiny)' if args.tiny else ''} params {n_params / 1e6:.2f}M policy {policy}")
    one, inf = torch.ones((), device=device), torch.full((), math.inf, device=device)
    log_every = args.log_every if args.log_every is not None else (1 if args.model == "mlp"
                                                                     else 10)
    tokens, t0 = 0, None
    for i in range(args.steps):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = batch_fn(i)
        bad = rank == args.inject_inf_rank and i in args.inject_inf_step
        state, m = step(state, x, y, inf if bad else one)
        if t0 is not None:
            tokens += y.numel()
        if (log_every and i % log_every == 0) or i == args.steps - 1:
            say(f"rank {rank} step {i} loss {float(m['loss']):.4f} skipped "
                f"{bool(m['skipped'])} scale {float(m['loss_scale']):g}"
                f"{' (inf injected here)' if bad else ''}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = ""
    if t0 is not None and tokens:
        unit = "tokens" if args.model == "gpt" else "samples"
        rate = f" {unit}/s {tokens / (time.perf_counter() - t0):.0f}"
    digest = params_digest(state.params)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest)
    same = len(set(digests)) == 1
    say(f"rank {rank} done: steps {args.steps} skips {int(state.skipped_total)} "
        f"params {digest} identical across ranks {same}{rate}")
    # every rank past its last collective before the group goes
    dist.barrier()
    dist.destroy_process_group()
    return 0 if same else 1


def exit_now(code: int) -> None:
    """Flush and leave without interpreter finalisation.

    Gloo's worker threads can still hold work objects whose tensors own Python references
    after ``destroy_process_group``; freeing them while the interpreter is being torn down
    aborts the process ("terminate called without an active exception", SIGABRT), as CI
    saw once on 2 loaded cores after every rank had printed its result (pytorch/pytorch
    PR 179291 describes the race). All work is done and flushed by then, so skip it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
