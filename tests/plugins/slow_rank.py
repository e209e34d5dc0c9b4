"""A user's task with a straggler: the rank named by SLOW_RANK sleeps SLOW_RANK_MS in every forward, as a
throttled GPU or a node with a noisy neighbour is slower at every step. And a rank that holds the interpreter's lock:
the rank named by HOLD_GIL_RANK, at its first training forward after the file HOLD_GIL_FILE appears (it removes it),
sleeps HOLD_GIL_MS in a C call that keeps the lock, as a long call of a user's extension does: its process lives, its
heartbeat thread cannot run. And a process that never finishes a step: the one whose launcher RANK is STUCK_RANK, at
its STUCK_AT_FORWARD-th training forward, sleeps for good (the lock released: its heartbeat goes on), as a rank stuck
in a user's code or a dead-locked data source is."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

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
        holds = os.environ.get("HOLD_GIL_RANK") == os.environ.get("RANK") and "HOLD_GIL_FILE" in os.environ
        self.hold = Path(os.environ["HOLD_GIL_FILE"]) if holds else None
        stuck = os.environ.get("STUCK_RANK") is not None and os.environ.get("STUCK_RANK") == os.environ.get("RANK")
        self.stuck_at = int(os.environ.get("STUCK_AT_FORWARD", "1")) if stuck else 0
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += self.training
        if self.stuck_at and self.forwards == self.stuck_at:
            print(f"stuck at training forward {self.forwards}", flush=True)
            while True:
                time.sleep(1)
        if self.delay_s and self.training:
            time.sleep(self.delay_s)
        if self.hold is not None and self.training and self.hold.exists():
            self.hold.unlink()
            held = time.monotonic()
            ctypes.PyDLL(None).usleep(int(os.environ.get("HOLD_GIL_MS", "2500")) * 1000)  # PyDLL: the lock stays held
            print(f"held the interpreter's lock for {time.monotonic() - held:.1f}s", flush=True)
        return self.net(x)


def task(config: Config) -> Task:
    gen = torch.Generator().manual_seed(config.data_seed)
    x = torch.randn(config.dataset_size or 4096, 16, generator=gen)
    torch.manual_seed(config.seed)
    return Task("straggler", Straggling(), TensorDataset(x, x.sum(1, keepdim=True)), nn.MSELoss())
