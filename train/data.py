"""The trainer's input pipeline: the same sample order on every path, resumable at any batch.

The order of an epoch is a pure function of (seed, epoch, rank, world size), taken from
`DistributedSampler`, so a resumed run continues at the exact sample position of the interrupted
one: batch `start` of epoch `e`, nothing replayed and nothing skipped.

Two paths share that order:
- `TensorBatches`: in-memory `TensorDataset`s are batched by tensor indexing in the training process
  (no per-sample Python objects, no collation, no worker processes to feed).
- `LoaderBatches`: any other map-style dataset goes through `torch.utils.data.DataLoader` with worker
  processes, prefetching, persistent workers and pinned memory on CUDA.

Random augmentation in a dataset repeats exactly after a resume because each batch is fetched under
RNG seeds derived from (seed, epoch, rank, batch index), not from whichever worker happens to fetch
it: after a resume the DataLoader hands batch `start` to worker 0, where the uninterrupted run had
given it to worker `start % workers`, so per-worker seeding alone could not repeat the run.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, get_worker_info

from train.affinity import allowed_cpus
from train.forensics import register_worker_stack_dump

Batch = tuple[torch.Tensor, torch.Tensor]


def default_num_workers(ranks_sharing: int) -> int:
    """DataLoader workers per rank: the CPUs this process may use, divided among the `ranks_sharing`
    them (the node's local ranks, or 1 once train.affinity has bound this rank to a slice of its
    own), less one for the rank itself; at least one (a worker overlaps loading with the gradient
    all-reduce even on a busy CPU) and at most 8."""
    cpus = len(allowed_cpus()) or os.cpu_count() or 1  # no affinity outside Linux
    return max(1, min(8, cpus // max(1, ranks_sharing) - 1))


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same on every machine and Python (unlike hash())."""
    digest = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class BatchKey:
    """What a worker needs to fetch one batch reproducibly."""

    epoch: int
    index: int
    indices: tuple[int, ...]


class EpochOrder:
    """This rank's sample order for an epoch, split into batches, starting at any batch."""

    def __init__(self, dataset_len: int, *, world_size: int, rank: int, batch_size: int, seed: int) -> None:
        self.sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.batch_size = batch_size
        self.batches_per_epoch = -(-len(self.sampler) // batch_size)

    def batches(self, epoch: int, start: int = 0) -> list[torch.Tensor]:
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(self.sampler)), dtype=torch.long)
        return list(order.split(self.batch_size))[start:]


class TensorBatches:
    """In-memory tensors batched by indexing: the fast path, no worker processes.

    The samples of up to CHUNK_BYTES of batches are gathered at once (one `index_select` a tensor, into pinned
    memory on a GPU, so that the copies to it do not block) and each step takes views of them: a gather a step
    cost two fresh tensors and two indexing calls a step on the host, which on an eager GPT on a GPU show in the
    step time. Same samples, same order. A chunk's pinned memory is reused only once its copies are done (torch's
    pinned-memory cache records the copies' stream)."""

    CHUNK_BYTES = 16 << 20

    def __init__(self, data: TensorDataset, order: EpochOrder, device: torch.device, *, pinned: bool = False) -> None:
        self.tensors = data.tensors
        self.order, self.device, self.pinned = order, device, pinned
        sample_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors) if len(self.tensors[0]) else 1
        self.chunk_batches = max(1, self.CHUNK_BYTES // max(1, sample_bytes * order.batch_size))

    def epoch(self, epoch: int, start: int) -> Iterator[Batch]:
        non_blocking = self.device.type == "cuda"
        batches = self.order.batches(epoch, start)
        for first in range(0, len(batches), self.chunk_batches):
            chunk = batches[first : first + self.chunk_batches]
            inputs, targets = (self._gather(t, torch.cat(chunk)) for t in self.tensors)
            end = 0
            for indices in chunk:
                begin, end = end, end + len(indices)
                yield (
                    inputs[begin:end].to(self.device, non_blocking=non_blocking),
                    targets[begin:end].to(self.device, non_blocking=non_blocking),
                )

    def _gather(self, tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":  # a dataset already on the GPU
            return tensor.index_select(0, index.to(tensor.device))
        out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=self.pinned)
        return torch.index_select(tensor, 0, index, out=out)

    def close(self) -> None:
        pass


class SeededBatches(Dataset):
    """Wraps a map-style dataset so each batch is fetched under RNG seeds derived from its BatchKey.

    In the training process itself (no workers) the global RNG state is restored afterwards, so
    fetching never disturbs the model's own randomness (dropout, initialisation): the CPU, Python and
    NumPy generators, and the CUDA ones, which torch.manual_seed seeds as well (dropout on a GPU
    draws from them; restored only once CUDA is initialised, as seeding does not initialise it)."""

    def __init__(self, dataset: Dataset, *, seed: int, rank: int) -> None:
        self.dataset, self.seed, self.rank = dataset, seed, rank

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, key: BatchKey) -> list[Any]:
        seed = derive_seed(self.seed, key.epoch, self.rank, key.index)
        in_main = get_worker_info() is None
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state()) if in_main else None
        cuda_saved = torch.cuda.get_rng_state_all() if in_main and torch.cuda.is_initialized() else None
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            fetch = getattr(self.dataset, "__getitems__", None)
            return list(fetch(list(key.indices))) if fetch else [self.dataset[i] for i in key.indices]
        finally:
            if saved is not None:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])
                np.random.set_state(saved[2])
            if cuda_saved is not None:
                torch.cuda.set_rng_state_all(cuda_saved)


class _KeyedBatchSampler:
    """Yields the BatchKeys of one epoch from a start batch; set before each `iter(loader)`."""

    def __init__(self, order: EpochOrder) -> None:
        self.order, self.epoch, self.start = order, 0, 0

    def __iter__(self) -> Iterator[BatchKey]:
        for offset, indices in enumerate(self.order.batches(self.epoch, self.start)):
            yield BatchKey(self.epoch, self.start + offset, tuple(indices.tolist()))

    def __len__(self) -> int:
        return self.order.batches_per_epoch - self.start


class LoaderBatches:
    """Any map-style dataset through a DataLoader: workers, prefetching, persistent workers, pinning."""

    def __init__(self, data: Dataset, order: EpochOrder, device: torch.device, *, num_workers: int, seed: int, rank: int) -> None:
        self.device = device
        self.sampler = _KeyedBatchSampler(order)
        # The workers' base seeds; DataLoader seeds torch, random and numpy in each worker from it.
        generator = torch.Generator().manual_seed(derive_seed(seed, rank))
        self.loader = DataLoader(
            SeededBatches(data, seed=seed, rank=rank),
            batch_sampler=self.sampler,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            persistent_workers=num_workers > 0,
            prefetch_factor=4 if num_workers > 0 else None,
            generator=generator,
            worker_init_fn=register_worker_stack_dump,  # a hang's forensics can ask them for their stacks
        )

    def epoch(self, epoch: int, start: int) -> Iterator[Batch]:
        self.sampler.epoch, self.sampler.start = epoch, start
        non_blocking = self.device.type == "cuda"
        for inputs, targets in self.loader:
            yield inputs.to(self.device, non_blocking=non_blocking), targets.to(self.device, non_blocking=non_blocking)

    def close(self) -> None:
        """Stop persistent workers now rather than at interpreter exit (which the trainer skips). The loader forgets
        them, so that a later epoch() (after an in-process recovery, train/recovery.py) starts new ones instead of
        resetting the stopped ones."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self.loader._iterator = None


def make_batches(
    data: Dataset, order: EpochOrder, device: torch.device, *, num_workers: int, seed: int, rank: int, pinned: bool = False
) -> TensorBatches | LoaderBatches:
    """`pinned`: gather in-memory batches into pinned memory (a GPU's; the DataLoader pins for CUDA itself)."""
    if isinstance(data, TensorDataset):
        return TensorBatches(data, order, device, pinned=pinned)
    return LoaderBatches(data, order, device, num_workers=num_workers, seed=seed, rank=rank)
