"""Tasks: a model, its data and its loss. Built-in ones learn; `--task module:factory` plugs in yours.

A factory takes the Config and returns a `Task`. Data that fits in memory should be a
`TensorDataset`: the trainer batches it by tensor indexing instead of one Python object per sample.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from train.config import Config

Metric = Callable[[torch.Tensor, torch.Tensor], dict[str, float]]


class TaskError(ValueError):
    """A --task that cannot be loaded."""


@dataclass
class Task:
    """What the trainer needs from a workload. `metric` is optional (run on rank 0 at epoch ends);
    `tokens_per_sample`, where a sample is a sequence, adds tokens/s to the progress lines and metrics."""

    name: str
    model: nn.Module
    train_data: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_data: TensorDataset | None = None
    metric: Metric | None = None
    tokens_per_sample: int | None = None


def _split(x: torch.Tensor, y: torch.Tensor, eval_fraction: float = 0.1) -> tuple[TensorDataset, TensorDataset]:
    n_eval = max(1, int(len(x) * eval_fraction))
    return TensorDataset(x[n_eval:], y[n_eval:]), TensorDataset(x[:n_eval], y[:n_eval])


def regression(config: Config) -> Task:
    """The seed article's workload (20 features -> 1), but learnable: targets come from a fixed linear
    teacher plus noise, and the loss is MSE (the tutorial's cross-entropy on one output is constant)."""
    size = config.dataset_size or 2048
    gen = torch.Generator().manual_seed(config.data_seed)
    x = torch.randn(size, 20, generator=gen)
    weight = torch.randn(20, 1, generator=gen) / 20**0.5  # unit-variance targets
    y = x @ weight + 0.5 + 0.1 * torch.randn(size, 1, generator=gen)
    train_data, eval_data = _split(x, y)

    def metric(out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"eval_mse": nn.functional.mse_loss(out, target).item()}

    torch.manual_seed(config.seed)
    return Task("regression", nn.Linear(20, 1), train_data, nn.MSELoss(), eval_data, metric)


def classification(config: Config) -> Task:
    """10 classes labelled by a fixed random teacher MLP: learnable, so accuracy climbs far above 10%."""
    size = config.dataset_size or 8192
    gen = torch.Generator().manual_seed(config.data_seed)
    x = torch.randn(size, 32, generator=gen)
    teacher = [torch.randn(32, 64, generator=gen) / 32**0.5, torch.randn(64, 10, generator=gen)]
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
    train_data, eval_data = _split(x, y)

    def metric(out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {
            "eval_loss": nn.functional.cross_entropy(out, target).item(),
            "eval_accuracy": (out.argmax(dim=1) == target).float().mean().item(),
        }

    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.05), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return Task("classification", model, train_data, nn.CrossEntropyLoss(), eval_data, metric)


BUILTIN_TASKS: dict[str, Callable[[Config], Task]] = {"regression": regression, "classification": classification}


def load_task(config: Config) -> Task:
    """A built-in task by name, or `package.module:factory` imported from the Python path."""
    if config.task in BUILTIN_TASKS:
        return BUILTIN_TASKS[config.task](config)
    module_name, sep, attr = config.task.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(BUILTIN_TASKS)
        raise TaskError(f"--task {config.task!r} is neither a built-in task ({known}) nor 'package.module:factory'")
    # The trainer runs with the working directory off the front of the path (see entrypoint's
    # trainer_command); the user's module is looked for there last, after the bundle and torch, and
    # then in DDPACK_PROJECT_DIR: the templates set it to the submission folder (as the container sees
    # it), since they run in a run folder of their own, and under pyxis the image's PYTHONPATH wins
    # over the job's.
    searched = [os.getcwd(), *([os.environ["DDPACK_PROJECT_DIR"]] if os.environ.get("DDPACK_PROJECT_DIR") else [])]
    for folder in searched:
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        where = " and ".join(searched)
        raise TaskError(f"--task {config.task!r}: cannot import {module_name!r} ({exc}); looked on PYTHONPATH and in {where}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"--task {config.task!r}: {module_name} has no callable {attr!r}")
    task = factory(config)
    if not isinstance(task, Task):
        raise TaskError(f"--task {config.task!r}: the factory returned {type(task).__name__}, expected train.tasks.Task")
    return task
