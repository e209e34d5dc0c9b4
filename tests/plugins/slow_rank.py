"""A user's task with a straggler: the rank named by SLOW_RANK sleeps SLOW_RANK_MS in every forward, as a
throttled GPU or a node with a noisy neighbour is slower at every step."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from train.config import Config
from train.tasks import Task


class Straggling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        slow = os.environ.get("SLOW_RANK")
        self.delay_s = float(os.environ.get("SLOW_RANK_MS", "20")) / 1e3 if slow is not None and slow == os.environ.get("RANK") else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s and self.training:
            time.sleep(self.delay_s)
        return self.net(x)


def task(config: Config) -> Task:
    gen = torch.Generator().manual_seed(config.data_seed)
    x = torch.randn(config.dataset_size or 4096, 16, generator=gen)
    torch.manual_seed(config.seed)
    return Task("straggler", Straggling(), TensorDataset(x, x.sum(1, keepdim=True)), nn.MSELoss())
