"""The one place the trainer reaches torch APIs newer than the oldest torch it runs on (2.8), each with its fallback.

Users' GPU images hold the torch their base came with (NGC, the Deep Learning AMIs, their own), often older than the
one the bundle's images pin; a call that exists only in the newest torch ended every run there (`all_gather_single`
on torch 2.11). A newer API is used where it exists, since it is where torch is going (2.13 warns on the older
spelling), and the older one where it does not. NEWER_APIS lists them for the test that trains with each one hidden.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (module, attribute): what this file falls back from when torch lacks it.
NEWER_APIS = (("torch.distributed", "all_gather_single"),)


def all_gather_into(output: torch.Tensor, value: torch.Tensor, *, async_op: bool) -> dist.Work | None:
    """Every rank's `value`, laid end to end in rank order in `output` (world size x numel): `all_gather_single`
    where torch has it, else `all_gather_into_tensor` (torch 2.8 to 2.11; gloo and NCCL both implement it)."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is not None:
        return gather(output, value, async_op=async_op)
    return dist.all_gather_into_tensor(output, value, async_op=async_op)
