"""A small causal transformer (token and position embeddings, dropout, tied input and output weights): the
model zoo's `gpt` task trains it at a toy size, bench/bench_gpu.py at GPT-2 small's shape."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, block_size: int = 16, dim: int = 32, heads: int = 2, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one parameter, two uses
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)  # GPT-2's: unit-scale rows would make the tied head's logits huge

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(positions))
        return self.head(self.norm(self.blocks(x)))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def bare_ddp_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: tuple[torch.Tensor, torch.Tensor], step: int, batch: int,
                  device: torch.device, mark: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Step `step` of the bare DDP loop the trainer is measured against (bench_gpu times it on a GPU, bench_host on
    the CPU, tests/test_step_overhead.py counts it): what a DDP tutorial writes, with DDP's defaults: slices of the
    token tensors, bf16 autocast, `zero_grad(set_to_none=True)`, backward, the optimizer's step. `mark(phase)` is
    called as each phase ends (data, forward, zero_grad, backward, optimizer), for a caller that times or counts them."""
    inputs, targets = tokens
    x = inputs[step * batch : (step + 1) * batch].to(device, non_blocking=True)
    y = targets[step * batch : (step + 1) * batch].to(device, non_blocking=True)
    ended = mark or (lambda phase: None)
    ended("data")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = next_token_loss(model(x), y)
    ended("forward")
    optimizer.zero_grad(set_to_none=True)
    ended("zero_grad")
    loss.backward()
    ended("backward")
    optimizer.step()
    ended("optimizer")
