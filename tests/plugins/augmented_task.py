"""A user's task whose dataset is not a TensorDataset and draws random augmentation per sample, to
exercise the DataLoader path: workers, per-batch seeds and exact resume."""

from __future__ import annotations

import os
import random
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from train.config import Config
from train.tasks import Task


class NoisyLinear(Dataset):
    """y = w.x + b; each fetch adds fresh noise from torch's and Python's global RNGs (augmentation)."""

    def __init__(self, size: int, seed: int, cost_s: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = self.x @ torch.randn(8, 1, generator=gen) + 0.3
        self.cost_s = cost_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cost_s:
            time.sleep(self.cost_s)  # I/O-bound loading: reading and decoding a sample from shared storage
        jitter = 0.05 * torch.randn(8) + 0.01 * random.random()
        return self.x[i] + jitter, self.y[i]


def make(config: Config) -> Task:
    size = config.dataset_size or 4096
    cost_s = float(os.environ.get("AUGMENTED_TASK_COST_S", "0"))
    data = NoisyLinear(size, config.data_seed, cost_s)
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    return Task("augmented", model, data, nn.MSELoss())
