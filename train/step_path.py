"""The trainer's device-dependent choices for its step, made in one place.

A step takes one of two paths, and the device decides which:
- CPU (gloo): every bucket's collective is launched by ddpack's hook and polled in `finish()`, small buckets
  exchanged whole (train/grad_sync.py says why); buckets of up to 25 MiB; the stop flags read at once.
- CUDA (NCCL): DDP's built-in C++ all-reduce hook (no Python on the autograd thread), DDP's own bucket sizes;
  the stop flags copied to the host a step late, read with no wait in the steady state; batches gathered a chunk
  at a time into pinned memory and copied without blocking.

Under --recovery a step is *confirmed* (`confirmed`): the optimizer runs only once every bucket's collective is
known to have completed on this rank, so that a step is applied whole or not at all (train/grad_sync.py's
`GradientSync.finish`). The CPU path's polled waits confirm by construction; on the CUDA path DDP's C++ hook still
syncs, and `finish()` has the host wait for the step's end and asks the NCCL backend's error state whether any
collective was aborted (an NCCL kernel aborted on a dead peer returns with partial sums); where torch's NCCL backend
has no error state to ask, ddpack's Python hook keeps each bucket's work and `finish()` checks each.

`StepPath.cuda_shaped()` takes the CUDA path's branches on any device: bench/bench_host.py measures the host
work of the GPU step on a CPU with it, and the quick tier counts that work's calls. Where a branch cannot exist
without CUDA (pinned memory, CUDA events) its stand-in is named in `stand_ins`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# On CPU every bucket, the first included, holds up to DDP's default 25 MiB. Left to its defaults DDP
# caps the first bucket at 1 MiB so that NCCL can start on it while backward goes on; with gloo
# on the CPU each collective costs thread wake-ups on cores that backward is using, and the bench's
# heavy MLP (1.05 MiB of gradients) synced as two buckets took 5.14 ms a step against 4.99 as one
# (5 interleaved rounds).
CPU_BUCKET_CAP_MB = 25


@dataclass(frozen=True, kw_only=True)
class StepPath:
    """Which branches the step takes (see the module docstring)."""

    polled_sync: bool  # collectives polled in finish() (CPU), else DDP waits on their futures (CUDA)
    late_stop_read: bool  # the stop flags read a step late through a host copy (CUDA), else at once
    bucket_cap_mb: float | None  # None: DDP's own (25 MiB, the first bucket 1 MiB)
    cuda: bool  # the device is a GPU: pinned memory and CUDA events exist
    confirmed: bool = False  # --recovery: the optimizer runs only after the step's collectives are confirmed complete

    @classmethod
    def for_device(cls, device: torch.device) -> StepPath:
        if device.type == "cuda":
            return cls(polled_sync=False, late_stop_read=True, bucket_cap_mb=None, cuda=True)
        return cls(polled_sync=True, late_stop_read=False, bucket_cap_mb=CPU_BUCKET_CAP_MB, cuda=False)

    @classmethod
    def cuda_shaped(cls, device: torch.device) -> StepPath:
        """The CUDA path's branches on `device` (a CPU for the host-overhead bench)."""
        return cls(polled_sync=False, late_stop_read=True, bucket_cap_mb=None, cuda=device.type == "cuda")

    @property
    def stand_ins(self) -> list[str]:
        """What stands in for a CUDA-only piece when the CUDA path runs without CUDA."""
        if self.cuda or self.polled_sync:
            return []
        confirmed = [
            "the host's wait for the step's end: a CUDA event, stood in for",
            "NCCL's error state: none (gloo keeps none; a failed gloo collective raises from DDP's wait, in backward)",
        ]
        return [
            "the stop flags' pinned host buffer: a plain CPU tensor",
            "its CUDA event: a stand-in whose query() is always true",
            "the pinned chunks batches are cut from: pageable CPU tensors",
            "NCCL: gloo (the same C++ all-reduce hook)",
            *(confirmed if self.confirmed else []),
        ]
