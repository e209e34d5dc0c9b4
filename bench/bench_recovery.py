"""Recovery table, the goodput view: what each disorderly or orderly ending costs a job on the real Slurm, on
today's path (the template requeues the job after every failure: DDPACK_RESTART_IN_PLACE=0) side by side with
ddpack's (it restarts the step in the same allocation, swapping in a spare node for a bad one).

For each path, one job of the bundled trainer through enroot/baremetal.sbatch: 4 ranks on two of the three test
nodes that testbed/slurm_cluster.py runs on this host, the third a spare (sbatch --nodes=3, DDPACK_SPARE_NODES=1;
today's path leaves it idle), --snapshot-every N, and one failure after another, each once the job has trained
again for a while:

- preemption: `scancel --signal=USR1` (what `--signal=USR1@90` sends before the time limit): requeued on both;
- killed rank: rank 3 SIGKILLed (the OOM killer): the survivors' collective fails;
- hung rank: rank 3 SIGSTOPped (a frozen process): the others' watchdogs end them after --hang-timeout,
  srun kills the frozen one DDPACK_STEP_WAIT seconds later;
- lost node: the node rank 3 runs on set DOWN (`scontrol update ... state=down`: a node failure or a health
  agent's verdict).

From rank 0's metrics file (its records carry wall-clock times, the same clock as the injection's here), the job
log and the injection's time, measured as bench_goodput.py measures them (recovery_timing.py):

- detect: until the failing segment's end record (the job knows and stops training); n/a where rank 0 wrote
  none (the lost node: Slurm SIGKILLs the step, rank 0 with it);
- decided: until the template's decision appears in the job log (the step has ended: requeue, or restart here);
- back: until the first progress record of the next start (training runs again); log: the same from the job log,
  until the restart's first progress line appears;
- replayed: steps trained before the failure that the resume trains again (the last one reached, minus the
  snapshot's step);
- lost: back + replayed x the median step time (the job's goodput loss for this failure).

Then the snapshot stall side by side with the write it no longer holds training for, from the jobs' own
snapshot records (median stall_s and write_s; `make bench`'s bench_snapshot.py has the 50 M-parameter case).
One round each. The floors: detect cannot beat the signal (preemption, a killed peer: ~0 s) or the hang timeout;
a requeue's back cannot beat Slurm's start of a requeued job (here the old credential's expiry, cred_expire=10 s);
back - decided is the trainer's start (imports, rendezvous, loading the snapshot, the first step). Needs root and
the test cluster; no image (bench_goodput.py measures the pyxis path, where a requeue also unpacks the image again).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from recovery_timing import NO_END, Recovery, follow, log_length, read_metrics  # noqa: E402

from testbed.slurm_jobs import job_state, progress_count, signal_tasks, submit, wait_for_progress  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Row:
    """One failure on one path: its recovery (recovery_timing.py) and what it cost the job."""

    path: str
    failure: str
    recovery: Recovery
    lost_s: float  # back + replayed x the median step time


def step_time(rows: list[dict]) -> float:
    """The median time between consecutive progress records of one start (--log-every 1: one step each)."""
    gaps = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(rows)
        if a["kind"] == b["kind"] == "progress" and b["global_step"] == a["global_step"] + 1
    ]
    return statistics.median(gaps) if gaps else 0.0


def measure(
    path: str, failure: str, inject: Callable[[], None], job: str, metrics: Path, log: Path, timeout: float = 600, no_end: str = NO_END
) -> Row:
    """Inject once training runs, then follow the metrics file and the job log until the next start trains
    (recovery_timing.follow: the next start's first progress record, not the failing job's own next one)."""
    skip, injected = log_length(log), time.time()
    inject()
    try:
        recovery = follow(metrics, log, injected, skip, timeout=timeout, no_end=no_end)
    except TimeoutError as exc:
        raise SystemExit(f"bench_recovery: after the {failure}: {exc} ({job_state(job)}); see {log}") from None
    return Row(path=path, failure=failure, recovery=recovery, lost_s=recovery.back_s + recovery.replayed * step_time(read_metrics(metrics)))


def one_path(path: str, in_place: bool, opts: argparse.Namespace, work: Path) -> tuple[list[Row], list[dict]]:
    """One job on three nodes, one of them a spare (sbatch --nodes=3, DDPACK_SPARE_NODES=1), and the four failures."""
    args = f"--dataset-size 32768 --epochs 3 --log-every 1 --snapshot-every {opts.snapshot_every} --hang-timeout {opts.hang_timeout:g}"
    folder = work / path.split()[0]
    folder.mkdir(parents=True, exist_ok=True)
    job, metrics, log = submit(
        folder, "recovery", ("--partition=big", "--nodes=3"), DDPACK_TRAIN_ARGS=args, DDPACK_MAX_FAILURE_RESTARTS="3",
        DDPACK_STEP_WAIT=str(opts.step_wait), DDPACK_SPARE_NODES="1", DDPACK_RESTART_IN_PLACE="1" if in_place else "0",
    )  # fmt: skip
    print(f"recovery, {path}: job {job}, 4 ranks on 2 nodes and a spare, trainer {args}, DDPACK_STEP_WAIT={opts.step_wait}; log {log}", flush=True)

    def rank_3(sig: signal.Signals) -> Callable[[], None]:
        def inject() -> None:
            if not any(signal_tasks(job, node, sig, rank=3) for node in ("ddnode1", "ddnode2", "ddnode3")):
                sys.exit("bench_recovery: no rank 3")

        return inject

    def node_down() -> None:  # the node rank 3 runs on: a spare is swapped in for it
        node = next(n for n in ("ddnode2", "ddnode3", "ddnode1") if signal_tasks(job, n, signal.SIGCONT, rank=3))
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=ddpack-bench-recovery"], check=True)

    lost = "no end record: the node set DOWN made Slurm SIGKILL the step, rank 0 with it"
    failures: list[tuple[str, Callable[[], None], str]] = [
        ("preemption", lambda: subprocess.run(["scancel", "--signal=USR1", job], check=True), NO_END),
        ("killed rank", rank_3(signal.SIGKILL), NO_END),
        ("hung rank", rank_3(signal.SIGSTOP), NO_END),
        ("lost node", node_down, lost),
    ]
    table = []
    try:
        for name, inject, no_end in failures:
            wait_for_progress(metrics, progress_count(metrics) + opts.train_between, log, f"the job did not train before the {name}")
            table.append(measure(path, name, inject, job, metrics, log, no_end=no_end))
            print(f"recovery: {table[-1]}", flush=True)
    finally:
        for node in ("ddnode1", "ddnode2", "ddnode3"):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        subprocess.run(["scancel", job], capture_output=True)
    return table, read_metrics(metrics)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot-every", type=int, default=20)
    parser.add_argument("--hang-timeout", type=float, default=30, help="the trainer's (default 180 s in a job; shorter here to keep the bench short)")
    parser.add_argument("--step-wait", type=int, default=30, help="DDPACK_STEP_WAIT (the templates' default is 120 s)")
    parser.add_argument("--train-between", type=int, default=40, help="progress records between one recovery and the next failure")
    opts = parser.parse_args()
    if shutil.which("sinfo") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        start = ".venv/bin/python testbed/slurm_cluster.py"
        print(f"bench_recovery: no Slurm controller answers (sinfo); start the test cluster: {start}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ddpack-bench-recovery-"))
    table, rows = [], []
    for path, in_place in (("requeue (today)", False), ("in place", True)):
        found, seen = one_path(path, in_place, opts, work)
        table += found
        rows += seen
    step = step_time(rows)
    snaps = [r for r in rows if r["kind"] == "snapshot"]
    setup = f"median step {step * 1000:.0f} ms, snapshot every {opts.snapshot_every} steps, hang timeout {opts.hang_timeout:g} s"
    print(f"\nrecovery table (one round each; {setup})")
    print(f"{'failure':<12} {'path':<16} {'detect s':>9} {'decided s':>10} {'back s':>8} {'log s':>7} {'replayed':>9} {'lost s':>8}  rank 0 ended")
    for failure in dict.fromkeys(r.failure for r in table):
        for row in (r for r in table if r.failure == failure):
            r = row.recovery
            detect = f"{r.detect_s:>9.1f}" if r.detect_s is not None else f"{'n/a':>9}"
            print(
                f"{row.failure:<12} {row.path:<16} {detect} {r.decided_s:>10.1f} {r.back_s:>8.1f} {r.log_back_s:>7.1f} {r.replayed:>9d} "
                f"{row.lost_s:>8.1f}  {r.ended}"
            )
    print(
        "  seconds after the failure: detect, rank 0 ended (its end record); decided, the step ended and the template requeued the job "
        "or restarted the step in its allocation; back, it trained again (the next start's first progress record); log, the same from "
        "the job log (the restart's first progress line, polled).\n"
        "  A requeue waits for Slurm to start the job again (here at least cred_expire=10 s, until the old job credential expires; on a "
        "busy cluster, the queue); a restart in place only for a new step. Preemption requeues on both paths (the allocation is wanted "
        "elsewhere). The floor of back is detect plus the trainer's start (imports, rendezvous, the snapshot, the first step)."
    )
    if snaps:
        stall = statistics.median(r["stall_s"] for r in snaps)
        write = statistics.median(r["write_s"] for r in snaps)
        print(
            f"snapshot ({len(snaps)} in the jobs): training held {stall * 1000:.1f} ms median against {(stall + write) * 1000:.1f} ms for the "
            f"synchronous write it replaces ({stall / (stall + write):.2f}x); 50 M parameters: bench/bench_snapshot.py"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
