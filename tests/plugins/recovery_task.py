"""A user's task with what in-process recovery must carry exactly: BatchNorm (running statistics, moved by every
forward), dropout (per-step RNG), a dataset that is not a TensorDataset (a DataLoader with workers, augmentation drawn
per sample: tests/plugins/augmented_task.py's). Its gradients make two DDP buckets at --bucket-cap-mb 0.01 (the later
layers' 16.9 KB, then the rest), so that a death can come between two buckets of one step."""

from __future__ import annotations

import torch
from torch import nn

from plugins.augmented_task import NoisyLinear
from train.config import Config
from train.tasks import Task


def make(config: Config) -> Task:
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return Task("recovery", model, NoisyLinear(config.dataset_size or 1024, config.data_seed), nn.MSELoss())
