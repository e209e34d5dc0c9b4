"""The one place the trainer reaches torch spellings that differ across the torch it runs on (2.8 and newer), each
with its fallback.

Users' GPU images hold the torch their base came with (NGC, the Deep Learning AMIs, their own), often older than the
one the bundle's images pin; a call that exists only in the newest torch ended every run there (`all_gather_single`
on torch 2.11). A newer spelling is used where it exists, since it is where torch is going (2.13 warns on the older
one), and the older one where it does not. NEWER_APIS lists the calls for the test that trains with each one hidden.
TORCH_FLOOR is the oldest torch ddpack runs on: pyproject.toml and the docs say the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TORCH_FLOOR = (2, 8)

# (module, attribute): what this file falls back from when torch lacks it.
NEWER_APIS = (("torch.distributed", "all_gather_single"),)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the installed torch's), e.g. '2.11.0+cu130' -> (2, 11)."""
    major, minor, *_ = (version or torch.__version__).split("+")[0].split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def all_gather_into(output: torch.Tensor, value: torch.Tensor, *, async_op: bool) -> dist.Work | None:
    """Every rank's `value`, laid end to end in rank order in `output` (world size x numel): `all_gather_single`
    where torch has it, else `all_gather_into_tensor` (torch 2.8 to 2.11; gloo and NCCL both implement it)."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is not None:
        return gather(output, value, async_op=async_op)
    return dist.all_gather_into_tensor(output, value, async_op=async_op)


def flight_recorder_size_var(version: str | None = None) -> str:
    """The variable that turns on NCCL's flight recorder (the last collectives of each rank, which a hang's forensics
    dump): torch 2.9 renamed it to TORCH_FR_BUFFER_SIZE and 2.11 warns on the old TORCH_NCCL_TRACE_BUFFER_SIZE, which
    torch 2.8 alone reads."""
    return "TORCH_FR_BUFFER_SIZE" if torch_version(version) >= (2, 9) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def abort_default_group() -> None:
    """Abort the default process group's communicators (NCCL: a kernel waiting on a dead peer never returns) before it
    is destroyed: torch has no public spelling (`_abort_process_group`, torch 2.6 and later, below the floor)."""
    dist.distributed_c10d._abort_process_group()


def set_collective_timeout(seconds: float) -> None:
    """Change the default group's collective timeout in flight (in-process recovery tightens it to the measured
    steps): torch has no public spelling of it (`_set_pg_timeout`, private since 2.0)."""
    from datetime import timedelta

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def ddp_buckets_final(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has rebuilt its buckets, after which they stay: it rebuilds them once, in the second step's forward,
    in the order the first backward made the gradients ready. torch has no public spelling of it (a private attribute
    since 1.x). Where a torch lacks it (tests/test_step_overhead.py tries it), this says False and the caller keeps zeroing the gradients one by one: slower
    on the host, the same numbers."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))
