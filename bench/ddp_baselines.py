"""The competitors the trainer is measured against, each one rank of a gloo job started with
RANK/WORLD_SIZE/MASTER_* in the environment. Prints one JSON line (rank 0): training samples/s and
steps/s with start-up excluded, timed from the first step to the last.

- `tutorial`: the seed article's ddp.py approach, re-implemented: a Python list of per-sample
  tensors (`MyTrainDataset`), a DataLoader with DistributedSampler and default collation,
  `Linear(20, 1)`, plain SGD, `loss.item()` where the tutorial reads it, cross-entropy as it has.
- `bare`: a minimal hand-written DDP loop: the same model and optimizer as the trainer (AdamW,
  constant LR), batches cut from tensors by index in DistributedSampler's order, nothing else.
- `floor`: the per-step floor: one all-reduce of the gradient's size between the ranks (and, the
  cheaper way for a small gradient, one all-gather of it summed locally), and one local
  forward/backward/optimizer step of the model without DDP, each timed alone and in a loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from bench_tasks import heavy

from train.affinity import bind_local_ranks
from train.config import parse_config
from train.distributed import DistContext
from train.tasks import regression


class MyTrainDataset(Dataset):
    """The tutorial's dataset: one (tensor, tensor) tuple per sample in a Python list."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


def report(steps: int, samples: int, seconds: float) -> None:
    if dist.get_rank() == 0:
        print(json.dumps({"steps_per_s": steps / seconds, "samples_per_s": samples / seconds, "steps": steps}), flush=True)


def tutorial(epochs: int, batch_size: int, size: int, lr: float) -> None:
    torch.manual_seed(0)
    dataset = MyTrainDataset(size)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset))
    model = DistributedDataParallel(nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    steps = samples = 0
    started = time.perf_counter()
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
            steps, samples = steps + 1, samples + len(source) * dist.get_world_size()
    report(steps, samples, time.perf_counter() - started)


def bare(epochs: int, batch_size: int, size: int, lr: float, task: str) -> None:
    config = parse_config(["--dataset-size", str(size), "--lr", str(lr)])
    made = heavy(config) if task == "heavy" else regression(config)
    x, y = made.train_data.tensors
    model = DistributedDataParallel(made.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    sampler = DistributedSampler(range(len(x)), shuffle=True, seed=0)
    steps = samples = 0
    started = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for indices in torch.tensor(list(sampler)).split(batch_size):
            loss = made.loss_fn(model(x[indices]), y[indices])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps, samples = steps + 1, samples + len(indices) * dist.get_world_size()
    report(steps, samples, time.perf_counter() - started)


def floor(iterations: int, batch_size: int, task: str) -> None:
    """The per-step floor: one local forward/backward/optimizer step of the model (no DDP) and one
    all-reduce of the gradient's size. Timed alone (medians), and together as a loop of exactly those
    two per iteration (mean seconds an iteration, which includes waiting for the other rank and the
    scheduler's wake-ups), with the all-reduce waited for by blocking and by polling; and the loop
    with the gradient exchanged instead (one all-gather, rows summed), as the trainer syncs buckets
    of up to train.grad_sync.EXCHANGE_MAX_BYTES gathered."""
    from train.distributed import wait_polling
    from train.torch_compat import all_gather_into

    config = parse_config(["--dataset-size", "2048"])
    made = heavy(config) if task == "heavy" else regression(config)
    model, (x, y) = made.model, made.train_data.tensors
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    gathered = torch.zeros(dist.get_world_size() * grad.numel())

    def exchange() -> None:
        wait_polling(all_gather_into(gathered, grad, async_op=True))
        gathered.view(dist.get_world_size(), -1).sum(0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def local_step() -> None:
        loss = made.loss_fn(model(x[:batch_size]), y[:batch_size])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def median_of(fn) -> float:
        for _ in range(20):
            fn()
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]

    def mean_of(fn) -> float:
        for _ in range(20):
            fn()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        return (time.perf_counter() - start) / iterations

    dist.barrier()
    all_reduce_s = median_of(lambda: dist.all_reduce(grad))
    dist.barrier()
    exchange_s = median_of(exchange)
    dist.barrier()
    local_s = median_of(local_step)
    loop_blocking_s = mean_of(lambda: (local_step(), dist.all_reduce(grad)))
    loop_polling_s = mean_of(lambda: (local_step(), wait_polling(dist.all_reduce(grad, async_op=True))))
    loop_exchange_s = mean_of(lambda: (local_step(), exchange()))
    if dist.get_rank() == 0:
        figures = {
            "all_reduce_s": all_reduce_s,
            "exchange_s": exchange_s,
            "local_step_s": local_s,
            "loop_blocking_s": loop_blocking_s,
            "loop_polling_s": loop_polling_s,
            "loop_exchange_s": loop_exchange_s,
        }
        print(json.dumps({**figures, "grad_elements": grad.numel()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("tutorial", "bare", "floor"))
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--task", choices=("regression", "heavy"), default="regression")
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--cpu-bind", choices=("auto", "none"), default="none", help="bind local ranks to CPU slices as the trainer does")
    opts = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if opts.cpu_bind == "auto":
        rank, world = dist.get_rank(), dist.get_world_size()
        bind_local_ranks(DistContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world, backend="gloo", device=torch.device("cpu"), host=""))
    try:
        if opts.which == "tutorial":
            tutorial(opts.epochs, opts.batch_size, opts.dataset_size, opts.lr)
        elif opts.which == "bare":
            bare(opts.epochs, opts.batch_size, opts.dataset_size, opts.lr, opts.task)
        else:
            floor(opts.iterations, opts.batch_size, opts.task)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
