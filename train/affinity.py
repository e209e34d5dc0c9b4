"""CPU binding: ranks that share one machine's CPUs each get a disjoint slice of them.

Why: two local gloo ranks on a 2-core machine, seed workload (bench/bench_train.py), 8 interleaved
rounds: unbound 54-65k samples/s, median 61k; bound 64-73k, median 70k, faster in every round (an
earlier run had unbound rounds at 30k); the heavy MLP ran the same bound or not (5.30 against 5.43
ms a step). Binding the training thread alone, not gloo's, was slower (median 64k). Unbound, the
scheduler moves the training threads and gloo's worker threads between cores, and both ranks'
threads often queue on one core while the gradient sync waits on a thread that cannot run. Bound,
a rank's training thread and its gloo threads take turns on the rank's own CPUs, and DataLoader
workers, forked later, inherit the slice.

Which ranks: those on one kernel (its boot id, so containers on one host count as one machine)
whose allowed CPU sets are identical: the ranks torchrun or the entrypoint started from one process,
or srun tasks that Slurm did not bind. Ranks that Slurm (--cpu-bind) or their cgroups already gave
different sets are left as they are, as is a group with fewer CPUs than ranks. Slices go in rank
order, contiguous and as even as the count allows, and are cut between physical cores, never
between a core's hyperthreads: where Linux numbers the siblings apart (0-47 then 48-95 on a
two-socket node), rank 0 of 8 gets CPUs 0-5,48-53, not 0-11, whose siblings would go to rank 4.

GPU ranks: each rank's slice is cut from the CPUs of its own GPU's NUMA node (the GPU's PCI device's
local_cpulist), not from wherever its local rank falls: on a p4d/p5 GPUs 0-3 sit on socket 0 and 4-7 on
socket 1, but CUDA_VISIBLE_DEVICES or a launcher's order can give local rank 0 a socket-1 GPU, whose
host-to-device copies and NCCL proxy thread would then cross the socket link every step. Where a node's
ranks' GPUs do not all say where they are, or a NUMA node has fewer CPUs than the ranks whose GPUs sit on
it, the slices go in rank order as above.

Limit: two separate jobs on one machine cannot see each other. Started with the same full CPU set
(plain `docker run` twice on a workstation), both would bind to the same slices; run such jobs with
`--cpu-bind none` (or DDPACK_CPU_BIND=none). Slurm gives each job its own cpuset, so jobs there
never meet.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from train import distributed
from train.distributed import DistContext, gather_objects


def machine_id() -> str:
    """The running kernel's boot id: the same in every container on one host, new at each boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return socket.gethostname()


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (empty where the OS cannot tell)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return ()


def physical_cores(cpus: tuple[int, ...]) -> list[tuple[int, ...]]:
    """`cpus` grouped by physical core (a core's hyperthreads together, as the kernel's topology
    lists them), in order of each core's first CPU; one CPU a core where the kernel does not say."""
    cores: dict[int, list[int]] = defaultdict(list)
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", encoding="ascii") as file:
                first = min(parse_cpu_list(file.read()))
        except (OSError, ValueError):
            first = cpu
        cores[first].append(cpu)
    return [tuple(cores[key]) for key in sorted(cores)]


def plan_slices(
    seen: list[tuple[str, tuple[int, ...]]],
    cores_of: Callable[[tuple[int, ...]], list[tuple[int, ...]]] = physical_cores,
    near: list[tuple[int, ...] | None] | None = None,
) -> list[tuple[int, ...] | None]:
    """For each rank's (machine, allowed CPUs), in rank order: the CPUs to bind it to, or None to
    leave it as it is. `near`: each rank's GPU's NUMA-local CPUs (None for a CPU rank or a GPU that
    does not say). `cores_of` groups CPUs by physical core (injected by the tests)."""
    sharing: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    for rank, key in enumerate(seen):
        sharing[key].append(rank)
    slices: list[tuple[int, ...] | None] = [None] * len(seen)
    for (_, cpus), ranks in sharing.items():
        if len(ranks) < 2 or len(cpus) < len(ranks):
            continue
        for group, members in _numa_groups(cpus, ranks, near):
            for rank, mine in zip(members, _split(group, len(members), cores_of), strict=True):
                slices[rank] = mine
    return slices


def _numa_groups(
    cpus: tuple[int, ...], ranks: list[int], near: list[tuple[int, ...] | None] | None
) -> list[tuple[tuple[int, ...], list[int]]]:
    """The ranks sharing `cpus` grouped by their GPU's NUMA-local CPUs, each group with those CPUs; one
    group of all of `cpus` when some rank's GPU does not say, or a NUMA node has fewer CPUs than ranks."""
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank in ranks:
        local = tuple(sorted(set(near[rank]) & set(cpus))) if near and near[rank] else ()
        if not local:
            return [(cpus, ranks)]
        groups[local].append(rank)
    if len(groups) < 2 or any(len(group) < len(members) for group, members in groups.items()):
        return [(cpus, ranks)]
    return list(groups.items())


def _split(cpus: tuple[int, ...], parts: int, cores_of: Callable[[tuple[int, ...]], list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """`cpus` cut into `parts` contiguous slices, as even as the count allows, between physical cores."""
    units = cores_of(cpus)
    if len(units) < parts:  # fewer cores than ranks: one CPU each, a core's threads to neighbours
        units = [(cpu,) for core in units for cpu in core]
    return [
        tuple(sorted(cpu for unit in units[i * len(units) // parts : (i + 1) * len(units) // parts] for cpu in unit)) for i in range(parts)
    ]


def gpu_local_cpus(device: torch.device, root: Path = Path("/")) -> tuple[int, ...] | None:
    """The CPUs of the NUMA node that `device`'s PCI slot hangs off (sysfs local_cpulist), or None for a CPU
    device or where the kernel does not say."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    slot = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        return parse_cpu_list((root / "sys/bus/pci/devices" / slot / "local_cpulist").read_text()) or None
    except (OSError, ValueError):
        return None


def bind_process(cpus: tuple[int, ...]) -> None:
    """Bind every thread of this process (gloo's and OpenMP's, started before this) to `cpus`;
    threads and processes started later inherit the binding."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended, or one we may not move
            os.sched_setaffinity(int(tid), cpus)


def cpu_list(cpus: tuple[int, ...]) -> str:
    """CPUs as taskset and /proc print them: `0-3,8,10-11`."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPUs of a list as the kernel and taskset write it (`0-3,8`)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def crowding(seen: list[tuple[str, tuple[int, ...]]], rank: int) -> str:
    """From every rank's (machine, allowed CPUs): where more ranks run on `rank`'s machine than the CPUs they may run on
    between them, how many share how few (`4 ranks share 2 CPUs on this machine`); "" where each has a CPU to itself,
    or the CPUs are not known. Its waits then sleep (train.distributed.crowding)."""
    machine = seen[rank][0]
    sets = [cpus for where, cpus in seen if where == machine]
    cpus = set().union(*sets)
    if not cpus or not all(sets) or len(sets) <= len(cpus):
        return ""
    return f"{len(sets)} ranks share {len(cpus)} CPU{'s' * (len(cpus) > 1)} on this machine"


def bind_local_ranks(ctx: DistContext) -> tuple[int, ...] | None:
    """Collective (once, at start-up): every rank says where it runs and on which CPUs; a rank that
    shares them with others binds itself to its slice. Returns the slice, or None if left as is. Where
    the ranks outnumber their CPUs, their waits sleep (`crowding`)."""
    if ctx.world_size == 1:  # nobody to share with: no collective at start-up
        return None
    seen = gather_objects((machine_id(), allowed_cpus(), gpu_local_cpus(ctx.device)), ctx)
    where = [(machine, cpus) for machine, cpus, _ in seen]
    distributed.crowding = crowding(where, ctx.rank)
    mine = plan_slices(where, near=[local for _, _, local in seen])[ctx.rank]
    if mine is not None:
        bind_process(mine)
    return mine


def left_free(seen: list[tuple[str, tuple[int, ...]]], rank: int) -> tuple[int, ...] | None:
    """For `rank` (a standby that took a dead rank's place), from every rank's (machine, allowed CPUs): the CPUs of its
    own allowed set that no other rank on its machine may run on, which is the slice of the rank it replaced when that
    rank ran here; None when nothing is left free (the others unbound, or the dead rank's slice on another machine)."""
    machine, mine = seen[rank]
    taken = {cpu for other, (where, cpus) in enumerate(seen) if other != rank and where == machine for cpu in cpus}
    free = tuple(cpu for cpu in mine if cpu not in taken)
    return free if free and len(free) < len(mine) else None


def bind_replacement(ctx: DistContext, replacing: bool) -> tuple[int, ...] | None:
    """Collective, after an in-process recovery: the standby that took a rank's place binds itself to the CPUs the
    bound ranks beside it leave free (the dead rank's slice), instead of running across all of them: unbound, it and
    the survivors' gloo threads queue on each other's cores (the recovered world trained at 0.66x before). Returns the
    CPUs it bound to, None elsewhere."""
    seen = gather_objects((machine_id(), allowed_cpus()), ctx)
    distributed.crowding = crowding(seen, ctx.rank)  # every rank's, again: the world's processes changed
    mine = left_free(seen, ctx.rank) if replacing else None
    if mine is not None:
        bind_process(mine)
    return mine
