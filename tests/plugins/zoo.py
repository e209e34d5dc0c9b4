"""The model zoo: the kinds of models users bring, written as a user writes a task for
`--task plugins.zoo:NAME` (a factory that takes the Config and returns a train.tasks.Task).

- `cnn`: a CNN with BatchNorm (running statistics: buffers that DDP does not reduce).
- `gpt`: a small causal transformer (token and position embeddings, dropout, tied input and output
  weights), for `--amp`, `--grad-accum` and `--clip-grad-norm`.
- `frozen`: a model whose first layer is frozen (requires_grad False), as in fine-tuning.
- `two_heads`: a model with a head that forward never uses (needs `--find-unused-parameters`).
- `image_files`: a map-style dataset read from .npy files in $ZOO_DATA_DIR with random augmentation
  (flips, shifts, noise), loaded through DataLoader workers; `write_image_files(DIR)` is its data prep.

Each keeps its data small: the tests train every model on two gloo ranks in seconds.
"""

from __future__ import annotations

import csv
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from testbed.gpt import TinyGPT, next_token_loss
from train.config import Config
from train.tasks import Task

IMAGE_SHAPE = (3, 12, 12)
CLASSES = 4


def accuracy(out: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    return {"eval_loss": F.cross_entropy(out, target).item(), "eval_accuracy": (out.argmax(dim=1) == target).float().mean().item()}


def synthetic_images(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class is the brightest quadrant of the first channel: learnable by a small CNN."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(size, *IMAGE_SHAPE, generator=gen)
    labels = torch.randint(0, CLASSES, (size,), generator=gen)
    half = IMAGE_SHAPE[1] // 2
    for quadrant in range(CLASSES):
        rows, cols = divmod(quadrant, 2)
        chosen = labels == quadrant
        images[chosen, 0, rows * half : (rows + 1) * half, cols * half : (cols + 1) * half] += 1.5
    return images, labels


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, CLASSES),
    )


def cnn(config: Config) -> Task:
    images, labels = synthetic_images(config.dataset_size or 1024, config.data_seed)
    train_data, eval_data = TensorDataset(images[128:], labels[128:]), TensorDataset(images[:128], labels[:128])
    torch.manual_seed(config.seed)
    return Task("zoo-cnn", small_cnn(), train_data, nn.CrossEntropyLoss(), eval_data, accuracy)


# ---------------------------------------------------------------- a small causal transformer


def gpt(config: Config) -> Task:
    """Next-token prediction on sequences that count up by a per-sequence stride (mod the vocabulary)."""
    size, vocab, length = config.dataset_size or 2048, 32, 16
    gen = torch.Generator().manual_seed(config.data_seed)
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    sequences = (start + stride * torch.arange(length + 1)) % vocab
    inputs, targets = sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()
    torch.manual_seed(config.seed)
    model = TinyGPT(vocab=vocab, block_size=length)
    train_data, eval_data = TensorDataset(inputs[128:], targets[128:]), TensorDataset(inputs[:128], targets[:128])
    return Task("zoo-gpt", model, train_data, next_token_loss, eval_data, tokens_per_sample=length)


# ---------------------------------------------------------------- frozen layers, an unused head


def classes_data(config: Config) -> TensorDataset:
    gen = torch.Generator().manual_seed(config.data_seed)
    x = torch.randn(config.dataset_size or 1024, 16, generator=gen)
    return TensorDataset(x, (x[:, :CLASSES]).argmax(dim=1))


def frozen(config: Config) -> Task:
    """Fine-tuning's shape: a pretrained first layer kept frozen, a new head trained."""
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    model[0].requires_grad_(False)
    return Task("zoo-frozen", model, classes_data(config), nn.CrossEntropyLoss())


class TwoHeads(nn.Module):
    """A trunk with two heads; this task trains through `main` only (the other is for another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.main, self.auxiliary = nn.Linear(32, CLASSES), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(self.trunk(x))


def two_heads(config: Config) -> Task:
    torch.manual_seed(config.seed)
    return Task("zoo-two-heads", TwoHeads(), classes_data(config), nn.CrossEntropyLoss())


# ---------------------------------------------------------------- a dataset read from files


def write_image_files(directory: Path, size: int = 512, seed: int = 7) -> None:
    """A user's data prep: one .npy file per image and a labels.csv naming each file's class."""
    directory.mkdir(parents=True, exist_ok=True)
    images, labels = synthetic_images(size, seed)
    with open(directory / "labels.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "label"])
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            name = f"img-{i:05d}.npy"
            np.save(directory / name, image.numpy())
            writer.writerow([name, int(label)])


class ImageFiles(Dataset):
    """Reads one image file per sample and augments it at random: a horizontal flip, a shift of up to
    one pixel (Python's RNG) and pixel noise (torch's RNG)."""

    def __init__(self, directory: Path) -> None:
        with open(directory / "labels.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        self.paths = [directory / row["file"] for row in rows]
        self.labels = [int(row["label"]) for row in rows]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.from_numpy(np.load(self.paths[i]))
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = torch.roll(image, shifts=(random.randint(-1, 1), random.randint(-1, 1)), dims=(1, 2))
        return image + 0.05 * torch.randn_like(image), torch.tensor(self.labels[i])


def image_files(config: Config) -> Task:
    torch.manual_seed(config.seed)
    return Task("zoo-image-files", small_cnn(), ImageFiles(Path(os.environ["ZOO_DATA_DIR"])), nn.CrossEntropyLoss())
