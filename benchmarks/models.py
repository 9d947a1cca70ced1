"""Benchmark models: a GPT-2-small-shaped transformer (no external deps) and ResNet-50."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50304  # 50257 padded to a multiple of 64, as nanoGPT does
    seq: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d: int = 768

    @classmethod
    def tiny(cls) -> GPTConfig:
        return cls(vocab=128, seq=32, n_layer=2, n_head=2, d=32)

    @classmethod
    def medium(cls) -> GPTConfig:
        """GPT-2 medium's shape (~350M params with the tied head)."""
        return cls(n_layer=24, n_head=16, d=1024)

    @classmethod
    def tiny_medium(cls) -> GPTConfig:
        """The smoke-test stand-in for medium: deeper and wider than tiny()."""
        return cls(vocab=128, seq=32, n_layer=3, n_head=4, d=64)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d)
        self.proj = nn.Linear(c.d, c.d)
        self.ln2 = nn.LayerNorm(c.d)
        self.fc = nn.Linear(c.d, 4 * c.d)
        self.out = nn.Linear(4 * c.d, c.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.d)
        self.wpe = nn.Embedding(c.seq, c.d)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d)
        self.head = nn.Linear(c.d, c.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith(("proj.weight",
                                                                        "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def gpt_flops_per_token(model: GPT) -> float:
    """6 N (forward + backward matmuls) + attention, per token (nanoGPT's estimate)."""
    c = model.c
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6.0 * n + 12.0 * c.n_layer * c.d * c.seq


def resnet50() -> nn.Module:
    import torchvision  # only the benchmark needs it (the GPU image has it)

    return torchvision.models.resnet50()
