"""A user's task whose dataset blocks forever on one rank, as a stuck read from shared storage does:
HANG_TASK_RANK's process (and its DataLoader workers) blocks at its HANG_TASK_AFTER-th fetched sample."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn
from torch.utils.data import Dataset

from train.config import Config
from train.tasks import Task


class StuckReads(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)
        self.fetched = 0
        self.stuck_rank = os.environ.get("HANG_TASK_RANK")
        self.after = int(os.environ.get("HANG_TASK_AFTER", "200"))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched += 1
        if os.environ.get("RANK") == self.stuck_rank and self.fetched > self.after:
            wait_for_storage_that_never_answers()
        return self.x[i], self.y[i]


def wait_for_storage_that_never_answers() -> None:
    threading.Event().wait()


def make(config: Config) -> Task:
    data = StuckReads(config.dataset_size or 4096, config.data_seed)
    torch.manual_seed(config.seed)
    return Task("stuck-reads", nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), data, nn.MSELoss())
