"""Workloads for bench/bench_train.py, as `--task bench_tasks:NAME` factories (the trainer imports
them from the working directory) and as plain functions the baseline loops call, so both sides
train the same model on the same data."""

from __future__ import annotations

import os
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


# The GPU bench's GPT (bench/bench_gpu.py): ~92M parameters, GPT-2 small's shape with an 8192-token vocabulary.
GPT_SHAPE = {"vocab": 8192, "block_size": 512, "dim": 768, "heads": 12, "layers": 12, "dropout": 0.0}
GPT_TINY = {"vocab": 64, "block_size": 16, "dim": 32, "heads": 2, "layers": 2, "dropout": 0.0}  # --dry-run-on-cpu


def gpt_model(tiny: bool = False) -> nn.Module:
    from testbed.gpt import TinyGPT  # the model zoo's GPT, at another size

    return TinyGPT(**(GPT_TINY if tiny else GPT_SHAPE))


def gpt_tokens(size: int, tiny: bool = False, seed: int = 0) -> TensorDataset:
    """Random token sequences (throughput does not depend on what the tokens say) and their next tokens."""
    shape = GPT_TINY if tiny else GPT_SHAPE
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape["vocab"], (size, shape["block_size"] + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def gpt(config: Config) -> Task:
    from testbed.gpt import next_token_loss

    tiny = os.environ.get("BENCH_GPT_TINY") == "1"
    torch.manual_seed(config.seed)
    model = gpt_model(tiny)
    data = gpt_tokens(config.dataset_size or 4096, tiny, config.data_seed)
    return Task("bench-gpt", model, data, next_token_loss, tokens_per_sample=(GPT_TINY if tiny else GPT_SHAPE)["block_size"])
