"""`python -m train`: flags -> task -> process group -> Trainer, with clear exits for every ending.

Exit codes: 0 done; 1 failure (collective error, checksum mismatch); 2 bad input; 124 a hang
(no rank finished a step for --hang-timeout; evidence in --forensics-dir); 128+N stopped by signal N
with a snapshot (143 for SIGTERM, 138 for SIGUSR1): rerun to resume. Once the process group is joined,
every ending prints the rank's end record last (train/outcome.py) and rank 0 appends it to the metrics file.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from entrypoint.plan import PlanError, job_token
from train import distributed, run_folder
from train.affinity import bind_local_ranks, cpu_list
from train.config import parse_config
from train.distributed import (
    DeviceError,
    collective_failure,
    default_to_one_process,
    exit_now,
    first_line,
    init_distributed,
    run_program,
    select_device,
    shutdown,
)
from train.metrics import MetricsFile, MetricsWriteError, RankLog
from train.model import SetupError
from train.outcome import RECOVERY_IMPOSSIBLE, RunEnd
from train.recovery import Membership, Recovery, RecoveryImpossible, enter, launcher_role, serve_store
from train.signals import PreemptionWatcher
from train.snapshot import SnapshotsUnreadable, SnapshotWriteError
from train.standby_forker import StandbyForker
from train.tasks import TaskError, load_task
from train.trainer import ChecksumMismatch, Preempted, SnapshotMismatch, Trainer
from train.watchdog import Progress, start_watchdog


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        job_token(os.environ)  # the launcher refuses a malformed one first; torchrun by hand does not
    except PlanError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    try:
        # A --standby started by the store task has its launcher environment (`train.standby_forker`): a standby, not the store.
        store_task = False
        if config.store_task and not config.standby:
            default_to_one_process()  # started by hand: one process, which the store task leaves no rank (one line, exit 2)
            store_task = launcher_role(config.standbys, dict(os.environ), store_task=True) == "store"
    except RecoveryImpossible as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    if store_task:  # the launcher's last process serves the job's store and trains nothing (no device, no task)
        launched = dict(os.environ)  # what a standby it starts is handed: the launcher's, as its own tasks had
        launcher_role(config.standbys, os.environ, store_task=True)
        import torch

        # A new standby for each one consumed, on this node: not where a GPU would idle for it (the node's ranks hold them).
        respawn = not torch.cuda.is_available()
        # The job program names the nodes Slurm drops from the job in the run folder, beside the metrics file.
        lost = Path(config.metrics_file).parent / run_folder.LOST_NODES if config.metrics_file else None
        # Forked before the store's server starts a thread: each new standby comes from it, warm (train/standby_forker.py).
        forker = StandbyForker(launched, sys.argv[1:], main, print_store_task) if respawn else None
        try:
            return serve_store(
                standbys=config.standbys, connect_s=config.collective_timeout, log=print_store_task, respawn=forker, lost_file=lost
            )
        finally:
            if forker is not None:
                forker.close()
    watcher = PreemptionWatcher()  # before the rendezvous, which can take a while under Slurm
    try:
        # The device first: a factory that allocates on CUDA allocates on this rank's GPU.
        backend, device = select_device(config.backend)
        task = load_task(config)
    except (TaskError, DeviceError) as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    membership: Membership | None = None
    try:
        if config.recovery:
            entered = enter(
                standby=config.standby,
                standbys=config.standbys,
                store_task=config.store_task,
                backend=backend,
                device=device,
                collective_timeout_s=config.collective_timeout,
                log=print_standby,
                watcher=watcher,
            )
            if entered is None:
                return 0  # a standby the run did not need; it never joined the group, so it leaves no end record
            ctx, membership = entered
        else:
            ctx = init_distributed(backend, device, config.collective_timeout)
    except RecoveryImpossible as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:
        first = first_line(exc)
        print(f"train: error: cannot join the process group: {first}", file=sys.stderr)
        return 1
    replacing = membership is not None and membership.replacing
    # Before the trainer starts DataLoader workers or torch's thread pool, so they inherit it. A collective of every rank at
    # their start: a standby that took a dead rank's place joins survivors past it, and runs unbound.
    bound = bind_local_ranks(ctx) if config.cpu_bind == "auto" and not replacing else None
    ctx = dataclasses.replace(ctx, cpus_bound=bound is not None)  # its slice is its own: workers default from all of it
    log = RankLog(ctx.rank, ctx.world_size)
    log(
        f"start: rank {ctx.rank} world {ctx.world_size} local_rank {ctx.local_rank}/{ctx.local_world_size} "
        f"backend {ctx.backend} device {ctx.device} host {ctx.host} task {task.name} pid {os.getpid()}"
        + (f" cpus {cpu_list(bound)}" if bound is not None else "")
        + (f"; {crowding}: its waits sleep between polls" if (crowding := distributed.crowding) else "")
    )
    metrics = MetricsFile(config.metrics_file if ctx.is_main else None, config.tensorboard if ctx.is_main else None)

    def record_end(end: RunEnd) -> None:
        """The rank's last line, and rank 0's last metrics record (a run refused before it trained leaves no file)."""
        log(end.line())
        if end.outcome != "bad-input":
            try:
                metrics.write("end", **end.fields())
            except MetricsWriteError as exc:  # the disk that ended the run may still be full: the log line stands
                log(f"warning: {exc}")

    progress = Progress()
    watchdog = None
    if config.hang_timeout:
        watchdog = start_watchdog(
            progress,
            store_name="ddpack-watchdog",
            rank=ctx.rank,
            world_size=ctx.world_size,
            host=ctx.host,
            timeout_s=config.hang_timeout,
            forensics_dir=Path(config.forensics_dir).absolute(),
            log=log,
            on_end=record_end,
        )
    trainer: Trainer | None = None
    run_over = False  # the whole run ends here (not this rank alone): in-process recovery's standbys may leave
    hard_exit = True  # leave without the closing barrier: a peer may be dead or waiting in a collective

    def ended(outcome: str, exit_code: int, **extra: Any) -> RunEnd:
        where = trainer.position() if trainer is not None else {}
        return RunEnd(rank=ctx.rank, world_size=ctx.world_size, host=ctx.host, outcome=outcome, exit_code=exit_code, **{**where, **extra})

    try:
        recovery = Recovery(membership, config.collective_timeout) if membership is not None else None
        trainer = Trainer(config, task, ctx, log, metrics, watcher, progress, recovery=recovery)
        if watchdog is not None:
            watchdog.know_hosts(trainer.hosts)  # gathered through the process group: heartbeats must agree
            if recovery is not None:
                recovery.hosts_changed = watchdog.know_hosts  # and again after an in-process recovery
        result = trainer.fit()
        loss = f"{result.final_loss:.5f}" if result.final_loss is not None else "n/a"
        log(
            f"done: global step {result.global_step} final loss {loss} steps/s {result.steps_per_s:.1f} samples/s {result.samples_per_s:,.0f}",
            main_only=True,
        )
        end = ended(
            "done",
            0,
            checksum=result.checksum,
            final_loss=result.final_loss,
            steps_per_s=result.steps_per_s,
            samples_per_s=result.samples_per_s,
        )
        hard_exit, run_over = False, True
    except SetupError as exc:  # found by every rank at set-up or the first steps, before anything was written
        if ctx.is_main:
            print(f"train: error: {exc}", file=sys.stderr, flush=True)
        end = ended("bad-input", 2, reason=str(exc))
        run_over = True
    except Preempted as stop:
        log(str(stop))
        end = ended("stopped", 128 + stop.signum, signal=stop.signal_name, snapshot=stop.snapshot)
        hard_exit, run_over = False, True
    except SnapshotMismatch as exc:  # every rank got the same snapshot, so every rank is here
        if ctx.is_main:
            print(f"train: error: {exc}", file=sys.stderr, flush=True)
        end = ended("bad-input", 2, reason=str(exc))
        hard_exit, run_over = False, True
    except SnapshotsUnreadable as exc:  # rank 0 alone; the others wait for the snapshot it would send
        log(f"error: {exc}")
        end = ended("bad-input", 2, reason=str(exc))
    except (SnapshotWriteError, MetricsWriteError) as exc:  # rank 0 alone; the others are in their next collective
        log(f"error: {exc}")
        end = ended("failed", 1, reason=str(exc), cause="own")
    except ChecksumMismatch as exc:
        log(f"error: {exc}")
        end = ended("failed", 1, reason=str(exc), cause="own")
        run_over = True
    except RecoveryImpossible as exc:  # the job program restarts every rank, as without --recovery
        why = f"{RECOVERY_IMPOSSIBLE}{exc}"
        log(f"recovery: falling back to a restart of every rank: {exc}")
        end = ended(
            "failed", 1, reason=why, cause="counted-dead" if membership is not None and membership.counted_dead else "recovery-fallback"
        )
        run_over = True
    except RuntimeError as exc:  # gloo/nccl report a dead or silent peer as RuntimeError subclasses; so does an OOM
        first, cause = first_line(exc), "peer" if collective_failure(exc) else "own"
        if cause == "peer":
            if watchdog is not None:
                watchdog.yield_to_a_declared_hang()  # a peer that exited on a declared hang: the watchdog ends this rank
            why = (
                f"a collective failed ({type(exc).__name__}: {first}); "
                f"a peer died or did not answer within --collective-timeout={config.collective_timeout:g}s"
            )
        else:
            why = f"{type(exc).__name__}: {first}"  # this rank's own error, not a peer's: said as it is
        log(f"error: {why}")
        end = ended("failed", 1, reason=why, cause=cause)
    finally:
        watcher.restore()
        if watchdog is not None:
            watchdog.stop()
        if membership is not None:
            membership.close(run_over=run_over)
    record_end(end)
    metrics.close()
    if hard_exit:
        exit_now(end.exit_code)  # tearing down a broken process group can itself hang
    shutdown()
    return end.exit_code


def print_store_task(line: str) -> None:
    print(f"[store] {line}", flush=True)


def print_standby(line: str) -> None:
    """A standby's lines before it has a rank (after, it logs as the rank it took)."""
    print(f"[standby] {line}", flush=True)


if __name__ == "__main__":
    run_program(main)
