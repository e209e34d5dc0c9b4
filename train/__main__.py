"""`python -m train`: flags -> task -> process group -> Trainer, with clear exits for every ending.

Exit codes: 0 done; 1 failure (collective error, checksum mismatch); 2 bad input; 124 a hang
(no rank finished a step for --hang-timeout; evidence in --forensics-dir); 128+N stopped by signal N
with a snapshot (143 for SIGTERM, 138 for SIGUSR1): rerun to resume.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from train.affinity import bind_local_ranks, cpu_list
from train.config import parse_config
from train.distributed import (
    DeviceError,
    exit_now,
    first_line,
    init_distributed,
    run_program,
    select_device,
    shutdown,
)
from train.metrics import MetricsFile, RankLog
from train.model import SetupError
from train.signals import PreemptionWatcher
from train.snapshot import SnapshotWriteError
from train.tasks import TaskError, load_task
from train.trainer import ChecksumMismatch, Preempted, SnapshotMismatch, Trainer
from train.watchdog import GuardedStore, Progress, Watchdog, tcp_store


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    watcher = PreemptionWatcher()  # before the rendezvous, which can take a while under Slurm
    try:
        # The device first: a factory that allocates on CUDA allocates on this rank's GPU.
        backend, device = select_device(config.backend)
        task = load_task(config)
    except (TaskError, DeviceError) as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    try:
        ctx = init_distributed(backend, device, config.collective_timeout)
    except (RuntimeError, ValueError) as exc:
        first = first_line(exc)
        print(f"train: error: cannot join the process group: {first}", file=sys.stderr)
        return 1
    # Before the trainer starts DataLoader workers or torch's thread pool, so they inherit it.
    bound = bind_local_ranks(ctx) if config.cpu_bind == "auto" else None
    ctx = dataclasses.replace(ctx, cpus_bound=bound is not None)  # its slice is its own: workers default from all of it
    log = RankLog(ctx.rank, ctx.world_size)
    log(
        f"start: rank {ctx.rank} world {ctx.world_size} local_rank {ctx.local_rank}/{ctx.local_world_size} "
        f"backend {ctx.backend} device {ctx.device} host {ctx.host} task {task.name} pid {os.getpid()}"
        + (f" cpus {cpu_list(bound)}" if bound is not None else "")
    )
    metrics = MetricsFile(config.metrics_file if ctx.is_main else None)
    progress = Progress()
    watchdog = None
    if config.hang_timeout:
        deadline = min(10.0, max(2.0, config.hang_timeout / 3))
        store = GuardedStore(tcp_store(deadline), deadline, prefix=f"ddpack-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        watchdog = Watchdog(
            progress,
            rank=ctx.rank,
            world_size=ctx.world_size,
            host=ctx.host,
            timeout_s=config.hang_timeout,
            forensics_dir=Path(config.forensics_dir).absolute(),
            log=log,
            store=store,
        )
        watchdog.start()
    try:
        result = Trainer(config, task, ctx, log, metrics, watcher, progress).fit()
    except SetupError as exc:  # found by every rank at set-up or the first steps, before anything was written
        if ctx.is_main:
            print(f"train: error: {exc}", file=sys.stderr, flush=True)
        metrics.close()
        exit_now(2)  # no barrier: a rank that did not find it may be waiting in a collective
    except Preempted as stop:
        log(str(stop))
        metrics.close()
        shutdown()
        return 128 + stop.signum
    except SnapshotMismatch as exc:  # every rank got the same snapshot, so every rank is here
        if ctx.is_main:
            print(f"train: error: {exc}", file=sys.stderr, flush=True)
        metrics.close()
        shutdown()
        return 2
    except SnapshotWriteError as exc:  # rank 0 alone; the others are in their next collective
        log(f"error: {exc}")
        metrics.close()
        exit_now(1)
    except ChecksumMismatch as exc:
        log(f"error: {exc}")
        return 1
    except RuntimeError as exc:  # gloo/nccl report a dead or silent peer as RuntimeError subclasses
        first = first_line(exc)
        log(
            f"error: a collective failed ({type(exc).__name__}: {first}); a peer died or did not answer "
            f"within --collective-timeout={config.collective_timeout:g}s"
        )
        exit_now(1)  # tearing down a broken process group can itself hang
    finally:
        watcher.restore()
        if watchdog is not None:
            watchdog.stop()
    loss = f"{result.final_loss:.5f}" if result.final_loss is not None else "n/a"
    log(
        f"done: global step {result.global_step} final loss {loss} steps/s {result.steps_per_s:.1f} samples/s {result.samples_per_s:,.0f}",
        main_only=True,
    )
    metrics.close()
    shutdown()
    return 0


if __name__ == "__main__":
    run_program(main)
