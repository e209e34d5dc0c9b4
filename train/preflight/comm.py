"""Communication: an all-reduce sweep in nccl-tests' layout, and a point-to-point ring across nodes.

Both use the job's own process group and backend (gloo on CPU, NCCL on GPU). Iteration counts are
agreed from the slowest rank's estimate, so every rank runs the same collectives and the sweep fits
its share of the time budget whatever the link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

from train.distributed import DistContext

SIZES = tuple(8 * 4**i for i in range(12))  # 8 B .. 32 MiB, as nccl-tests' -b 8 -e 32M -f 4
MAX_ITERS = 200
WARMUP = 5
P2P_BYTES = 4 << 20
# A link is slow when it moves less than this fraction of the median link's bandwidth.
SLOW_LINK_FRACTION = 0.5


@dataclass(frozen=True)
class AllReduceRow:
    """One line of the sweep: time per iteration (`_timed` says which statistic), averaged over ranks
    (nccl-tests' -a 1)."""

    size: int
    count: int
    iters: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int


@dataclass(frozen=True)
class Link:
    """Bandwidth from `src` to `dst`, measured by the receiver while every rank sends and receives."""

    src: int
    dst: int
    src_host: str
    dst_host: str
    gbps: float


def _sync(ctx: DistContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _reduced(value: float, op: dist.ReduceOp, ctx: DistContext, group: dist.ProcessGroup) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=op, group=group)
    return float(tensor.item())


def _agreed_iterations(one_s: float, seconds: float, ctx: DistContext, group: dist.ProcessGroup) -> int:
    """Iterations that fit `seconds` on the slowest rank, the same number on every rank."""
    slowest = _reduced(one_s, dist.ReduceOp.MAX, ctx, group)
    return max(1, min(MAX_ITERS, int(seconds / max(slowest, 1e-9))))


def _timed(step, ctx: DistContext, group: dist.ProcessGroup, seconds: float) -> tuple[int, float]:
    """Warm `step` up, agree on a count, run it that many times; returns (iterations, the median
    iteration's seconds).

    On CPU (gloo) the median, where nccl-tests prints the mean: on a shared or small node a blocked
    collective is sometimes woken milliseconds late, and a mean over a hundred iterations then
    follows the scheduler's tail from one run to the next, where the median follows the link. On a
    GPU the collectives are queued on a stream and nothing sleeps on the host: the mean over the
    iterations with one synchronisation at the end, as nccl-tests times them (a synchronisation per
    iteration would add the launch latency to every small message)."""
    step()
    _sync(ctx)
    started = time.perf_counter()
    step()
    _sync(ctx)
    iters = _agreed_iterations(time.perf_counter() - started, seconds, ctx, group)
    for _ in range(WARMUP):  # back into step with each other after the count's collective
        step()
    _sync(ctx)
    if ctx.device.type == "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(ctx)
        return iters, (time.perf_counter() - started) / iters
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        step()
        _sync(ctx)
        times.append(time.perf_counter() - started)
    return iters, median(times)


def bus_factor(world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n: what each link carries per byte reduced."""
    return 2 * (world - 1) / world if world > 1 else 0.0


def all_reduce_sweep(ctx: DistContext, group: dist.ProcessGroup, seconds: float, sizes: Sequence[int] = SIZES) -> list[AllReduceRow]:
    """float32 sum all-reduce over `sizes` bytes; first checks the result (#wrong elements, all ranks)."""
    rows = []
    per_size = seconds / len(sizes)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    for size in sizes:
        count = max(1, size // 4)
        tensor = torch.full((count,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
        dist.all_reduce(tensor, group=group)
        wrong = int(_reduced(float((tensor != expected).sum()), dist.ReduceOp.SUM, ctx, group))
        tensor.zero_()  # timed iterations of zeros: sums of sums would reach inf
        iters, each = _timed(lambda t=tensor: dist.all_reduce(t, group=group), ctx, group, per_size)
        each = _reduced(each, dist.ReduceOp.SUM, ctx, group) / ctx.world_size
        algbw = count * 4 / each / 1e9
        rows.append(AllReduceRow(count * 4, count, iters, each * 1e6, algbw, algbw * bus_factor(ctx.world_size), wrong))
    return rows


def ring_shift(hosts: Sequence[str]) -> int:
    """How far each rank's peer is: the first rank on another host than rank 0's, so that every pair
    crosses nodes when nodes hold equal blocks of ranks (srun's block layout, torchrun) or alternate
    (`--distribution=cyclic`); on one host, the next rank."""
    return next((rank for rank, host in enumerate(hosts) if host != hosts[0]), 1)


def p2p_ring(ctx: DistContext, group: dist.ProcessGroup, hosts: Sequence[str], seconds: float, nbytes: int = P2P_BYTES) -> list[Link]:
    """Every rank sends to rank+shift and receives from rank-shift at once; every rank gets all links."""
    world = ctx.world_size
    if world < 2:
        return []
    shift = ring_shift(hosts)
    dst, src = (ctx.rank + shift) % world, (ctx.rank - shift) % world
    count = nbytes // 4
    send = torch.ones(count, dtype=torch.float32, device=ctx.device)
    recv = torch.empty(count, dtype=torch.float32, device=ctx.device)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    _, each = _timed(exchange, ctx, group, seconds)
    rates = torch.zeros(world, dtype=torch.float64, device=ctx.device)
    rates[ctx.rank] = count * 4 / each / 1e9
    dist.all_reduce(rates, group=group)
    return [Link((r - shift) % world, r, hosts[(r - shift) % world], hosts[r], float(rates[r])) for r in range(world)]


def slow_links(links: Sequence[Link]) -> list[str]:
    """One line per link well below the median link, naming both ends."""
    if len(links) < 2:
        return []
    typical = median(link.gbps for link in links)
    return [
        f"p2p: slow link rank {link.src} ({link.src_host}) -> rank {link.dst} ({link.dst_host}): "
        f"{link.gbps:.3g} GB/s against a median of {typical:.3g} GB/s"
        for link in links
        if link.gbps < SLOW_LINK_FRACTION * typical
    ]
