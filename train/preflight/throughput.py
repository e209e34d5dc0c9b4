"""`--preflight-strict` on GPUs: host-to-device and device-to-device copy rates and each node's all-reduce bus
bandwidth, against floors per GPU model from the public GPU health suites (not only against the job's own median,
which a job of uniformly slow nodes passes).

The floors (`FLOORS`) and the verdict (`judge`) are pure; the measurements are torch's own copies and NCCL all-reduces,
timed on the host around device synchronisations (a copy of hundreds of MiB takes milliseconds, which the
synchronisation's microseconds do not blur). Local ranks take turns for the copies, as nvbandwidth measures one GPU
at a time: eight GPUs copying from the host at once share the host's memory and root ports.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.distributed import DistContext, gather_objects
from train.preflight.comm import bus_factor
from train.preflight.verdict import NodeCheck

GIB = 1 << 30
H2D_BYTES = 256 << 20
D2D_BYTES = 512 << 20
REPEATS = 5
ALL_REDUCE_GPUS = 8  # the floors' shape: eight GPUs of one node on NVLink


@dataclass(frozen=True, kw_only=True)
class GpuFloor:
    """What a healthy GPU of `model` does at least, and where the figures come from."""

    model: str  # a regular expression matched in torch's device name
    h2d_gbps: float
    d2d_gbps: float | None  # None: no published floor (the check is skipped)
    busbw_gbps: float | None
    all_reduce_bytes: int
    source: str


AZURE = "Azure/azurehpc-health-checks"
FLOORS = (
    GpuFloor(model=r"H200(?! NVL)", h2d_gbps=48, d2d_gbps=335, busbw_gbps=431, all_reduce_bytes=16 * GIB,
             source=f"{AZURE} conf/nd96isr_h200_v5.conf: check_gpu_bw 48 335, check_nccl_allreduce 431.0 at 16G"),
    GpuFloor(model=r"H100 80GB HBM3|H100 SXM", h2d_gbps=48, d2d_gbps=335, busbw_gbps=460, all_reduce_bytes=16 * GIB,
             source=f"{AZURE} conf/nd96isr_h100_v5.conf: check_gpu_bw 48 335, check_nccl_allreduce 460.0 at 16G"),
    GpuFloor(model=r"A100-SXM4", h2d_gbps=24, d2d_gbps=None, busbw_gbps=228, all_reduce_bytes=8 * GIB,
             source=f"{AZURE} conf/nd96asr_v4.conf: check_cuda_bw 24, check_nccl_allreduce 228.0 at 8G"),
)  # fmt: skip


def floor_for(device_name: str, floors: Sequence[GpuFloor] = FLOORS) -> GpuFloor | None:
    return next((floor for floor in floors if re.search(floor.model, device_name)), None)


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One rank's measurements (its GPU's copies; a node's first rank also carries the node's all-reduce)."""

    host: str
    device_name: str
    gpu: int
    h2d_gbps: float | None = None
    d2d_peer: int | None = None
    d2d_gbps: float | None = None
    busbw_gbps: float | None = None
    all_reduce_bytes: int = 0
    node_gpus: int = 0


def _rate_row(node: str, check: str, found: Sequence[tuple[str, float]], floor: float | None, model: str, action: str) -> NodeCheck:
    if floor is None:
        return NodeCheck(
            node=node, check=check, value="not measured against a floor", threshold=f"no published floor for {model}", status="skip"
        )
    slow = [(where, rate) for where, rate in found if rate < floor]
    low = min(found, key=lambda item: item[1]) if found else None
    value = "; ".join(f"{where}: {rate:.1f} GB/s" for where, rate in slow) or (
        f"lowest {low[1]:.1f} GB/s ({low[0]})" if low else "not measured"
    )
    return NodeCheck(node=node, check=check, value=value, threshold=f">= {floor:g} GB/s ({model})", status="fail" if slow else "ok",
                     device=", ".join(where for where, _ in slow), action=action)  # fmt: skip


def judge(records: Sequence[Measured], floors: Sequence[GpuFloor] = FLOORS) -> list[NodeCheck]:
    """The rows of every node: h2d and d2d per GPU, the node's all-reduce, each against its model's floor."""
    rows: list[NodeCheck] = []
    for node in dict.fromkeys(record.host for record in records):
        mine = [record for record in records if record.host == node]
        model = mine[0].device_name
        floor = floor_for(model, floors)
        if floor is None:
            rows.append(NodeCheck(node=node, check="gpu-floors", value=model, threshold="a GPU model with published floors", status="skip",
                                  action="the strict floors cover " + ", ".join(f.model for f in floors)))  # fmt: skip
            continue
        h2d = [(f"GPU {r.gpu}", r.h2d_gbps) for r in mine if r.h2d_gbps is not None]
        rows.append(_rate_row(node, "h2d", h2d, floor.h2d_gbps, model,
                              "host-to-GPU copies are slow: a PCIe link trained down (nvidia-smi -q: PCIe Generation, Link Width), "
                              "or another process copying; drain the node"))  # fmt: skip
        d2d = [(f"GPU {r.gpu}->{r.d2d_peer}", r.d2d_gbps) for r in mine if r.d2d_gbps is not None]
        if d2d:
            rows.append(_rate_row(node, "d2d", d2d, floor.d2d_gbps, model,
                                  "GPU-to-GPU copies are slow: an NVLink down or degraded (nvidia-smi nvlink -s), or the fabric "
                                  "manager not running; drain the node"))  # fmt: skip
        bus = next((r for r in mine if r.busbw_gbps is not None), None)
        if bus is not None and bus.node_gpus == ALL_REDUCE_GPUS and floor.busbw_gbps is not None:
            size = f"{bus.all_reduce_bytes / GIB:g} GiB"
            rows.append(NodeCheck(
                node=node, check="all-reduce-busbw", value=f"{bus.busbw_gbps:.1f} GB/s at {size}",
                threshold=f">= {floor.busbw_gbps:g} GB/s at {floor.all_reduce_bytes // GIB} GiB, 8 GPUs ({model})",
                status="ok" if bus.busbw_gbps >= floor.busbw_gbps else "fail",
                action="the node's NVLink all-reduce is slow: a link or NVSwitch degraded, clocks throttled; drain the node",
            ))  # fmt: skip
        elif bus is not None:
            rows.append(NodeCheck(node=node, check="all-reduce-busbw", value=f"{bus.busbw_gbps:.1f} GB/s on {bus.node_gpus} GPUs",
                                  threshold="floors are for 8 GPUs of one node", status="skip"))  # fmt: skip
    return rows


# --------------------------------------------------------------------------- measuring (CUDA)


def best_seconds(op: Callable[[], object], sync: Callable[[], None], repeats: int = REPEATS) -> float:
    """The fastest of `repeats` runs of `op`, after one to warm up."""
    op()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        op()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def h2d_gbps(device: torch.device, nbytes: int = H2D_BYTES) -> float:
    """Pinned host memory to `device`, as nvbandwidth's host_to_device_memcpy_ce does."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / best_seconds(lambda: gpu.copy_(host, non_blocking=True), lambda: torch.cuda.synchronize(device)) / 1e9


def d2d_gbps(src: torch.device, dst: torch.device, nbytes: int = D2D_BYTES) -> float:
    """`src` to `dst` (peer to peer over NVLink where it is)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)

    def sync() -> None:
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)

    return nbytes / best_seconds(lambda: b.copy_(a, non_blocking=True), sync) / 1e9


def all_reduce_size(floor_bytes: int, free_bytes: int) -> int:
    """The floor's size where a third of the GPU's free memory holds it, else the largest power of two that does
    (0 below 1 GiB: too small to compare with a floor measured at 8 or 16 GiB)."""
    size = floor_bytes
    while size > free_bytes // 3 and size >= GIB:
        size //= 2
    return size if size >= GIB else 0


def node_groups(hosts: Sequence[str]) -> list[list[int]]:
    """The ranks of each host, in first-seen order: one all-reduce group a node."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def node_busbw(ctx: DistContext, group: dist.ProcessGroup, ranks: Sequence[int], nbytes: int) -> float:
    """The all-reduce bus bandwidth of one node's ranks (nccl-tests' busbw: algbw x 2(n-1)/n), best of 3."""
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=ctx.device)
    seconds = best_seconds(lambda: dist.all_reduce(tensor, group=group), lambda: torch.cuda.synchronize(ctx.device), repeats=3)
    return nbytes / seconds / 1e9 * bus_factor(len(ranks))


def measure(ctx: DistContext, group: dist.ProcessGroup, hosts: Sequence[str]) -> list[Measured]:
    """Every rank's measurements, on every rank. Collective: every rank of `group` calls it."""
    name = torch.cuda.get_device_name(ctx.device)
    gpu = ctx.device.index or 0
    local = node_groups(hosts)
    turns = max(len(ranks) for ranks in local)
    h2d = d2d = None
    peer = None
    for turn in range(turns):
        dist.barrier(group=group)
        if ctx.local_rank == turn:
            h2d = h2d_gbps(ctx.device)
            if torch.cuda.device_count() > 1:
                peer = (gpu + 1) % torch.cuda.device_count()
                d2d = d2d_gbps(ctx.device, torch.device("cuda", peer))
    floor = floor_for(name)
    size = all_reduce_size(floor.all_reduce_bytes if floor else 0, torch.cuda.mem_get_info(ctx.device)[0])
    agreed = torch.tensor([size], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    size = int(agreed.item())
    mine = next(ranks for ranks in local if ctx.rank in ranks)
    busbw = None
    # One group a node, made by every rank (new_group is collective); the nodes measure at once, each on its own NVLink.
    subgroups = [dist.new_group(ranks) for ranks in local] if size and turns > 1 else []
    if subgroups and len(mine) > 1:
        busbw = node_busbw(ctx, subgroups[local.index(mine)], mine, size)
    own = Measured(host=ctx.host, device_name=name, gpu=gpu, h2d_gbps=h2d, d2d_peer=peer, d2d_gbps=d2d,
                   busbw_gbps=busbw if ctx.rank == mine[0] else None, all_reduce_bytes=size, node_gpus=len(mine))  # fmt: skip
    return gather_objects(own, ctx, group, allowed=[Measured])
