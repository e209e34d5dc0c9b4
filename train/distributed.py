"""Process-group set-up and the few collectives the trainer runs besides DDP's own (loss at log
intervals, checksums, state); stops are agreed inside DDP's gradient sync (`train.signals`)."""

from __future__ import annotations

import io
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from train.gpu import gpus_expected, gpus_promised, why_no_cuda
from train.torch_compat import flight_recorder_size_var


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Where this process stands, as the launcher (or torchrun) described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    host: str
    cpus_bound: bool = False  # bound to a slice of CPUs of its own (train.affinity), shared with no other rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (a one-process rendezvous; the tests'
    and benches' jobs). The launcher keeps its own copy: it never imports torch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class DeviceError(ValueError):
    """This rank cannot have a device of its own: one line for the user, exit 2."""


def choose_cuda_index(local_rank: int, local_world: int, visible: int, environ: Mapping[str, str]) -> int:
    """The CUDA device of local rank `local_rank` of `local_world` when torch sees `visible` GPUs.

    One GPU per rank: two ranks on one GPU make NCCL fail at its first collective ("Duplicate GPU
    detected"), after minutes of start-up on a cluster. One GPU visible to a rank of several is
    fine when Slurm gave each task its own (--gpus-per-task, --gpu-bind: CUDA_VISIBLE_DEVICES then
    names one GPU, a different one in each task); with CUDA_VISIBLE_DEVICES unset the node has one GPU."""
    if visible >= local_world:
        return local_rank
    if visible == 1 and environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    raise DeviceError(
        f"{local_world} ranks on this node but torch sees {visible} GPU{'s' if visible != 1 else ''} "
        f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start one rank per GPU "
        f"(--nproc-per-node {visible}, or srun --ntasks-per-node={visible})"
    )


def select_device(backend: str | None) -> tuple[str, torch.device]:
    """(backend, device) for this rank, from LOCAL_RANK/LOCAL_WORLD_SIZE (0 and 1 without a launcher); sets the CUDA device, so
    that what runs next (the user's task factory, DataLoader pinning) allocates on this rank's GPU
    rather than on GPU 0 from every rank."""
    if backend is None:
        if not torch.cuda.is_available() and (promised := gpus_promised(os.environ)):
            raise DeviceError(
                f"Slurm gave this job {promised} GPU(s) on this node (SLURM_GPUS_ON_NODE) but torch sees none: {why_no_cuda(os.environ)}"
            )
        if not torch.cuda.is_available() and gpus_expected(os.environ):
            raise DeviceError(f"this node has NVIDIA GPUs but torch sees none: {why_no_cuda(os.environ)}")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend != "nccl":
        return backend, torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"backend nccl needs a CUDA device, but torch sees none: {why_no_cuda(os.environ)}")
    index = choose_cuda_index(_env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1), torch.cuda.device_count(), os.environ)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return backend, device


def turn_on_flight_recorder() -> None:
    """torch's NCCL flight recorder: the last collectives of each rank, which a hang's forensics dump (train.watchdog);
    a ring of 2000 entries costs a few MB of host memory. A value the user set stays."""
    os.environ.setdefault(flight_recorder_size_var(), "2000")


def init_distributed(backend: str, device: torch.device, timeout_s: float) -> DistContext:
    """Join the process group described by the environment (env:// rendezvous), on the backend and
    device `select_device` chose; a one-process group without a launcher."""
    default_to_one_process()
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if backend == "nccl":
        turn_on_flight_recorder()
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return DistContext(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, backend=backend, device=device, host=node_name()
    )


def default_to_one_process() -> None:
    """Run without a launcher, this is a one-process group on loopback, so `python -m train` works alone."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())


def node_name() -> str:
    """The node as the scheduler names it (SLURMD_NODENAME under srun, pyxis included), else the host
    name: where several slurmd share one host, or a container has its own host name, this is the
    name an operator can act on (drain it, look it up in sinfo)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def waits_by_polling(device: torch.device) -> bool:
    """gloo on CPU: a blocked wait is woken late on small nodes (train.grad_sync says why); NCCL's
    work runs on a CUDA stream and nothing waits on the host."""
    return device.type == "cpu"


# In-process recovery's (train.recovery.Membership) check, called with the seconds waited so far while a collective is
# waited on: it raises when the job has already judged a peer dead, so that a survivor whose own peers are alive does
# not wait out the collective's timeout (gloo cannot cancel a collective). None without --recovery.
abandon_check: Callable[[float], None] | None = None
ABANDON_POLL_S = 0.02  # how often a waiting rank asks (one store round trip)


class Waitable(Protocol):
    """What `wait_polling` waits on: a collective's dist.Work, or a CUDA event seen as one (train.grad_sync)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> Any: ...


# Whether this rank's waits spin (sched_yield) or sleep between polls: they spin where the rank's CPUs are its own, and
# sleep where more ranks share them than they have CPUs (`crowding` says how many share how few: set at start-up and
# after a recovery by train.affinity; "" where they do not). There a spinning waiter takes the CPU from the rank it waits
# for, and the scheduler, which balances runnable tasks by count, can leave two waiters spinning on one CPU and the two
# ranks they wait for sharing the other: on the test cluster (4 ranks on 2 CPUs) runs went at 11-16k samples/s spinning
# and 21-30k sleeping, and a recovered run at random half as fast. MPI libraries do the same (Open MPI stops spinning
# when it finds a node oversubscribed).
crowding = ""
CROWDED_POLL_S = 0.0002  # a crowded waiter's sleep between polls: a wake-up costs about this, the CPU goes to the others


def wait_polling(work: Waitable) -> None:
    """Wait for a collective without letting the core go idle (see train.grad_sync for why), or, on CPUs more ranks
    share than they have (`crowding`), sleeping between polls; raises the collective's error (a dead peer, --collective-timeout) as work.wait() does, or
    `abandon_check`'s."""
    started = time.monotonic()
    next_check = started + ABANDON_POLL_S  # a collective done within the first poll asks nothing
    while not work.is_completed():
        if abandon_check is not None and (now := time.monotonic()) >= next_check:
            next_check = now + ABANDON_POLL_S
            abandon_check(now - started)
        if crowding:
            time.sleep(CROWDED_POLL_S)
        else:
            os.sched_yield()  # releases the GIL and lets this node's gloo threads run
    work.wait()


def sum_over_ranks(loss_sum: torch.Tensor, counts: list[float], ctx: DistContext) -> list[float]:
    """[loss sum, *counts] summed over ranks, in one all-reduce. The loss sum stays on the device
    until here, so this is the trainer's only host sync for losses (every --log-every steps)."""
    tensor = torch.cat([loss_sum.reshape(1).to(torch.float64), torch.tensor(counts, dtype=torch.float64, device=loss_sum.device)])
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    if waits_by_polling(tensor.device):
        wait_polling(work)
    else:
        work.wait()
    return tensor.tolist()


# What a peer sends is loaded as torch.load(weights_only=True) loads a file: tensors, numbers, text and plain containers,
# and the dataclasses a caller names (`allowed`). pickle, which all_gather_object and broadcast_object_list unpickle
# with, runs whatever code the bytes name: one process that joins the group (another user who wrote the rendezvous
# keys of a store anyone can reach) would run code as every rank. Nothing that crosses between ranks is unpickled.
def _packed(obj: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)


def _unpacked(data: torch.Tensor, allowed: Sequence[type], map_location: torch.device) -> Any:
    with torch.serialization.safe_globals(list(allowed)):
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=map_location, weights_only=True)


def _wire(group: dist.ProcessGroup | None, ctx: DistContext) -> torch.device:
    """Where the bytes travel: the rank's GPU on NCCL (which carries device tensors only), host memory otherwise."""
    return ctx.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _finish(work: dist.Work, wire: torch.device) -> None:
    """An object collective's wait: under in-process recovery (`abandon_check`) polled as the step's all-reduces are, so
    that a rank waiting in one ends it on the job's decision. Without it, a rank that is no ring neighbour of the dead
    one (gloo tells only those) sat in a snapshot's gather until the collective timeout while the others formed the
    next group without it (a recovery on the test cluster fell back so: rank 3 of 4, 20 s late). Plainly otherwise."""
    if abandon_check is not None and waits_by_polling(wire):
        wait_polling(work)
    else:
        work.wait()


def gather_objects(obj: Any, ctx: DistContext, group: dist.ProcessGroup | None = None, allowed: Sequence[type] = ()) -> list[Any]:
    """Every rank's `obj`, on every rank: what weights_only loads hold, plus the dataclasses in `allowed` (see above).
    `group`: one spanning every rank with its own timeout (the preflight's)."""
    wire = _wire(group, ctx)
    data = _packed(obj, wire)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=wire)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    _finish(dist.all_gather(sizes, size, group=group, async_op=True), wire)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=wire)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in sizes]
    _finish(dist.all_gather(out, padded, group=group, async_op=True), wire)
    return [_unpacked(got[: int(n)], allowed, torch.device("cpu")) for got, n in zip(out, sizes, strict=True)]


def broadcast_objects(obj: Any, ctx: DistContext, src: int, map_location: torch.device | None = None, allowed: Sequence[type] = ()) -> Any:
    """Rank `src`'s `obj` on every rank (only `src`'s argument is read), loaded as weights_only loads are (with the
    dataclasses in `allowed`), its tensors onto `map_location` (the receiver's own device: never the sender's index)."""
    wire = _wire(None, ctx)
    data = _packed(obj, wire) if ctx.rank == src else torch.empty(0, dtype=torch.uint8, device=wire)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=wire)
    _finish(dist.broadcast(size, src=src, async_op=True), wire)
    if ctx.rank != src:
        data = torch.empty(int(size), dtype=torch.uint8, device=wire)
    _finish(dist.broadcast(data, src=src, async_op=True), wire)
    return obj if ctx.rank == src else _unpacked(data, allowed, map_location or torch.device("cpu"))


def broadcast_from_main(obj: Any, ctx: DistContext, allowed: Sequence[type] = ()) -> Any:
    """Rank 0's `obj` on every rank: only rank 0 needs to see the snapshot directory."""
    return broadcast_objects(obj, ctx, src=0, allowed=allowed)


def broadcast_buffers(module: torch.nn.Module, ctx: DistContext, src: int = 0) -> None:
    """Rank 0's buffers (BatchNorm's running statistics...) on every rank, one broadcast per dtype:
    what DDP does before each forward, done once more after the last one. `src`: another rank's, after a
    recovery in which a survivor holds rank 0's (train.trainer.buffer_holder)."""
    buffers = [b for b in module.buffers() if b.numel()]
    if ctx.world_size == 1 or not buffers:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for group in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in group])
        dist.broadcast(flat, src=src)
        for buffer, synced in zip(group, flat.split([b.numel() for b in group]), strict=True):
            buffer.copy_(synced.view_as(buffer))


def shutdown() -> None:
    """Leave together: a rank that tears down its group while a peer is still mid-collective can
    abort the peer (seen with gloo as "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# gloo reports a dead or silent peer as a plain RuntimeError whose message names its transport (".../gloo/transport/
# tcp/pair.cc:553] Connection closed by peer", "... Timed out waiting 5000ms for recv"); NCCL's and the store's
# failures are torch.distributed.DistError. Nothing else that a rank raises (an OOM, a failed snapshot write, a
# user's own RuntimeError) is a peer's failure.
GLOO_FAILURE = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "ProcessGroupGloo")


def collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure (a peer died, or did not answer in time), not this rank's own error."""
    if isinstance(exc, dist.DistError) or getattr(exc, "peer_failure", False):
        return True
    return type(exc) is RuntimeError and any(marker in str(exc) for marker in GLOO_FAILURE)


def first_line(exc: BaseException) -> str:
    """An exception as one line for the user: its message's first line, else its type (gloo and NCCL
    errors run to many lines; an empty message still says what happened)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def exit_now(code: int) -> None:
    """Flush and leave without running interpreter teardown. Once the process group is destroyed and
    every file is closed there is nothing left to clean up, but torch's C++ statics (gloo and TCPStore
    threads) can still abort the process on the way out ("terminate called without an active
    exception"), turning a finished run into exit -6 at random."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_program(main: Callable[[], int]) -> None:
    """`python -m train` and `python -m train.preflight` end here: argparse's --help (0) and bad flags
    (2) become exit codes too, and every ending goes through exit_now."""
    try:
        status = main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    exit_now(status)
