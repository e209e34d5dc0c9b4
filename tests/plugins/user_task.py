"""A user's own task, plugged in with `--task plugins.user_task:make` (no edit to the bundle)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from train.config import Config
from train.tasks import Task


class Squares(Dataset):
    """A map-style dataset of Python objects, to exercise the non-tensor batching path."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([i / 256.0])
        return x, x * x


def make(config: Config) -> Task:
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    return Task("squares", model, Squares(), nn.MSELoss())


def not_a_task(config: Config) -> str:
    return "nope"
