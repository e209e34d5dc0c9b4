"""Compute: each rank's matrix-multiply rate, and the ranks well below the median (stragglers).

A straggler (a throttled GPU, a node with a noisy neighbour, a node with slower cores) sets the
pace of every synchronous step. The rate is the best of several timed chunks, so a transient blip on
a healthy rank is not mistaken for a slow one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

from train.distributed import DistContext, gather_objects

STRAGGLER_FRACTION = 0.75
CHUNKS = 5


@dataclass(frozen=True)
class Rate:
    rank: int
    host: str
    gflops: float


def matmul_shape(device: torch.device) -> tuple[int, torch.dtype]:
    """bf16 8192^3 on a GPU (tensor cores), float32 512^3 on a CPU core."""
    return (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)


def matmul_gflops(ctx: DistContext, seconds: float) -> float:
    """The best rate over CHUNKS timed chunks that together take about `seconds`."""
    n, dtype = matmul_shape(ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    a = torch.randn(n, n, dtype=dtype, device=ctx.device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=ctx.device, generator=gen)

    def run(times: int) -> float:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        started = time.perf_counter()
        for _ in range(times):
            torch.mm(a, b)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return time.perf_counter() - started

    run(1)
    per_chunk = max(1, int(seconds / CHUNKS / max(run(1), 1e-6)))
    best = min(run(per_chunk) for _ in range(CHUNKS)) / per_chunk
    return 2 * n**3 / best / 1e9


def measure_rates(ctx: DistContext, group: dist.ProcessGroup, local_ranks: int, seconds: float) -> list[Rate]:
    """Every rank's rate, on every rank. GPU ranks measure at once (each owns its device); CPU ranks
    of one host take turns, one per host at a time, so ranks that share a node's cores (more ranks
    than cores, as in a two-core test) are not mistaken for stragglers of each other, while a node
    that is slower than the others, or busy with someone else's work, still is."""
    turns = 1 if ctx.device.type == "cuda" else local_ranks
    gflops = 0.0
    for turn in range(turns):
        dist.barrier(group=group)
        if turns == 1 or ctx.local_rank == turn:
            gflops = matmul_gflops(ctx, seconds / turns)
    return gather_objects(Rate(ctx.rank, ctx.host, gflops), ctx, group, allowed=[Rate])


def stragglers(rates: Sequence[Rate]) -> list[str]:
    """One line per host with ranks below STRAGGLER_FRACTION of the median rate."""
    if len(rates) < 2:
        return []
    typical = median(rate.gflops for rate in rates)
    slow: dict[str, list[Rate]] = {}
    for rate in rates:
        if rate.gflops < STRAGGLER_FRACTION * typical:
            slow.setdefault(rate.host, []).append(rate)
    return [
        f"compute: straggler host {host}: "
        + ", ".join(f"rank {r.rank} {r.gflops:.3g} GFLOP/s" for r in group)
        + f" against a median of {typical:.3g} GFLOP/s (below {STRAGGLER_FRACTION:.0%})"
        for host, group in slow.items()
    ]
