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
order, contiguous (neighbouring CPUs share caches) and as even as the count allows.

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


def plan_slices(seen: list[tuple[str, tuple[int, ...]]]) -> list[tuple[int, ...] | None]:
    """For each rank's (machine, allowed CPUs), in rank order: the CPUs to bind it to, or None to
    leave it as it is."""
    sharing: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    for rank, key in enumerate(seen):
        sharing[key].append(rank)
    slices: list[tuple[int, ...] | None] = [None] * len(seen)
    for (_, cpus), ranks in sharing.items():
        if len(ranks) < 2 or len(cpus) < len(ranks):
            continue
        for i, rank in enumerate(ranks):
            slices[rank] = cpus[i * len(cpus) // len(ranks) : (i + 1) * len(cpus) // len(ranks)]
    return slices


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


def bind_local_ranks(ctx: DistContext) -> tuple[int, ...] | None:
    """Collective (once, at start-up): every rank says where it runs and on which CPUs; a rank that
    shares them with others binds itself to its slice. Returns the slice, or None if left as is."""
    mine = plan_slices(gather_objects((machine_id(), allowed_cpus()), ctx))[ctx.rank]
    if mine is not None:
        bind_process(mine)
    return mine
