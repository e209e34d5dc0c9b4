"""A user's task whose dataset records, at its first sample, the CPUs each thread of the process
fetching it may run on: the rank itself with --num-workers 0 (its gloo threads included), else a
DataLoader worker. tests/test_train_dist.py reads the records to see what the trainer's CPU binding did."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset, get_worker_info

from train.config import Config
from train.tasks import Task, regression


def thread_cpus() -> dict[str, str]:
    """Each thread of this process: the CPUs it may run on, as /proc lists them (`0-3,8`)."""
    seen = {}
    for tid in os.listdir("/proc/self/task"):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        seen[tid] = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
    return seen


class Probe(Dataset):
    def __init__(self, data: TensorDataset, out: Path) -> None:
        self.x, self.y = data.tensors
        self.out, self.recorded = out, False

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.recorded:
            self.recorded = True
            record = {"rank": int(os.environ["RANK"]), "worker": get_worker_info() is not None, "threads": thread_cpus()}
            path = self.out / f"rank{record['rank']}-{os.getpid()}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").rename(path)
        return self.x[i], self.y[i]


def make(config: Config) -> Task:
    task = regression(config)
    return Task("affinity-probe", task.model, Probe(task.train_data, Path(os.environ["AFFINITY_PROBE_DIR"])), task.loss_fn)
