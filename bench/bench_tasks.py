"""Workloads for bench/bench_train.py, as `--task bench_tasks:NAME` factories (the trainer imports
them from the working directory) and as plain functions the baseline loops call, so both sides
train the same model on the same data."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from train.config import Config
from train.tasks import Task, regression


def heavy(config: Config) -> Task:
    """The seed data with a compute-heavier model: an MLP 20 -> 512 -> 512 -> 1 (~270k parameters)."""
    task = regression(config)
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    return Task("heavy", model, task.train_data, nn.MSELoss())


class SlowSamples(Dataset):
    """A map-style dataset whose __getitem__ takes ~1 ms, as reading and decoding a sample from
    shared storage does (time.sleep: the cost is waiting, not this machine's two cores)."""

    def __init__(self, data: TensorDataset, cost_s: float = 0.001) -> None:
        self.x, self.y = data.tensors
        self.cost_s = cost_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.cost_s)
        return self.x[i], self.y[i]


def slow_samples(config: Config) -> Task:
    task = regression(config)
    return Task("slow-samples", task.model, SlowSamples(task.train_data), task.loss_fn)
