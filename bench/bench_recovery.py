"""Recovery table, the goodput view: what each disorderly or orderly ending costs a job on the real Slurm.

One job of the bundled trainer through enroot/baremetal.sbatch (4 ranks on the two test nodes that
testbed/slurm_cluster.py runs on this host, --snapshot-every N), and one failure after another, each once the
job has trained again for a while:

- preemption: `scancel --signal=USR1` (what `--signal=USR1@90` sends before the time limit);
- killed rank: rank 3 SIGKILLed (the OOM killer): the survivors' collective fails;
- hung rank: rank 3 SIGSTOPped (a frozen process): the others' watchdogs end them after --hang-timeout,
  srun kills the frozen one DDPACK_STEP_WAIT seconds later;
- lost node: `scontrol update nodename=ddnode2 state=down` (a node failure or a health agent's verdict).

Each is followed by the template's requeue and the resume from the last snapshot. From rank 0's metrics file
(its records carry wall-clock times, the same clock as the injection's here), the job log and the injection's time:

- detect: until rank 0's end record (the job knows and stops training);
- requeued: until scontrol's restart count goes up (the step has ended and the template requeued the job);
- restarted: until the requeued job's banner appears in the job log (Slurm's requeue and restart);
- back: until the first progress record of the next start (training runs again);
- replayed: steps trained before the failure that the resume trains again (the last one reached, minus the
  snapshot's step);
- lost: back + replayed x the median step time (the job's goodput loss for this failure).

Then the snapshot stall side by side with the write it no longer holds training for, from the job's own
snapshot records (median stall_s and write_s; `make bench`'s bench_snapshot.py has the 50 M-parameter case).
One round: every failure is a real requeue through slurmctld (tens of seconds each). The floors: detect
cannot beat the signal (preemption, a killed peer: ~0 s) or the hang timeout; restarted - requeued cannot beat
Slurm's start of a requeued job (here the old credential's expiry, cred_expire=10 s); back - restarted is the
trainer's start (imports, rendezvous, loading the snapshot, the first step). Needs root and the test
cluster; no image.
"""

from __future__ import annotations

import argparse
import itertools
import json
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
sys.path.insert(0, str(ROOT))

from testbed.slurm_jobs import job_state, progress_count, signal_tasks, submit, wait_for_progress  # noqa: E402


@dataclass(frozen=True)
class Recovery:
    failure: str
    detect_s: float  # injection -> rank 0's end record
    requeued_s: float  # injection -> the job requeued (scontrol's restart count goes up): the step ended, the template decided
    restarted_s: float  # injection -> the next start's banner in the job log (Slurm's requeue and start)
    back_s: float  # injection -> the next start's first progress record
    replayed: int
    lost_s: float
    how_it_ended: str


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []


def step_time(rows: list[dict]) -> float:
    """The median time between consecutive progress records of one start (--log-every 1: one step each)."""
    gaps = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(rows)
        if a["kind"] == b["kind"] == "progress" and b["global_step"] == a["global_step"] + 1
    ]
    return statistics.median(gaps) if gaps else 0.0


def banners(log: Path) -> int:
    return log.read_text().count("ddpack: job ") if log.exists() else 0


def measure(failure: str, inject: Callable[[], None], job: str, metrics: Path, log: Path, timeout: float = 600) -> Recovery:
    """Inject once training runs, then follow the metrics file and the job log (its lines carry no times:
    the next start's banner is timed as it appears, polled every 0.1 s) until the next start trains."""
    seen, started_before, restarts_before = len(records(metrics)), banners(log), job_state(job)[2]
    injected, requeued, restarted = time.time(), None, None
    inject()
    deadline = time.monotonic() + timeout
    while True:
        if requeued is None and job_state(job)[2] > restarts_before:
            requeued = time.time()
        if restarted is None and banners(log) > started_before:
            restarted = time.time()
        rows = records(metrics)[seen:]
        ends = [i for i, r in enumerate(rows) if r["kind"] == "end"]
        after = [r for r in rows[ends[0] + 1 :] if r["kind"] == "progress"] if ends else []
        if after and requeued is not None and restarted is not None:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_recovery: the job did not train again after the {failure} within {timeout:.0f}s ({job_state(job)}); see {log}")
        time.sleep(0.1)
    end, first = rows[ends[0]], after[0]
    before = max((r["global_step"] for r in records(metrics)[: seen + ends[0]] if r["kind"] == "progress"), default=0)
    replayed = max(0, before - (first["global_step"] - 1))
    back = first["time"] - injected
    return Recovery(
        failure=failure,
        detect_s=end["time"] - injected,
        requeued_s=requeued - injected,
        restarted_s=restarted - injected,
        back_s=back,
        replayed=replayed,
        lost_s=back + replayed * step_time(records(metrics)),
        how_it_ended=f"{end['outcome']} (exit {end['exit_code']})",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot-every", type=int, default=20)
    parser.add_argument("--hang-timeout", type=float, default=30, help="the trainer's (default 180 s in a job; shorter here to keep the bench short)")
    parser.add_argument("--step-wait", type=int, default=30, help="DDPACK_STEP_WAIT (the templates' default is 120 s)")
    parser.add_argument("--train-between", type=int, default=40, help="progress records between one recovery and the next failure")
    opts = parser.parse_args()
    if shutil.which("sinfo") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        start = ".venv/bin/python testbed/slurm_cluster.py"
        print(f"bench_recovery: no Slurm controller answers (sinfo); start the two-node test cluster: {start}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ddpack-bench-recovery-"))
    args = f"--dataset-size 32768 --epochs 3 --log-every 1 --snapshot-every {opts.snapshot_every} --hang-timeout {opts.hang_timeout:g}"
    job, metrics, log = submit(
        work, "recovery", DDPACK_TRAIN_ARGS=args, DDPACK_MAX_FAILURE_RESTARTS="3", DDPACK_STEP_WAIT=str(opts.step_wait)
    )
    print(f"recovery: job {job}, 4 ranks on 2 nodes, trainer {args}, DDPACK_STEP_WAIT={opts.step_wait}; log {log}", flush=True)

    def node_down() -> None:
        subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=down", "reason=ddpack-bench-recovery"], check=True)

    failures: list[tuple[str, Callable[[], None]]] = [
        ("preemption", lambda: subprocess.run(["scancel", "--signal=USR1", job], check=True)),
        ("killed rank", lambda: signal_tasks(job, "ddnode2", signal.SIGKILL, rank=3) or sys.exit("bench_recovery: no rank 3 on ddnode2")),
        ("hung rank", lambda: signal_tasks(job, "ddnode2", signal.SIGSTOP, rank=3) or sys.exit("bench_recovery: no rank 3 on ddnode2")),
        ("lost node", node_down),
    ]
    table = []
    try:
        for name, inject in failures:
            wait_for_progress(metrics, progress_count(metrics) + opts.train_between, log, f"the job did not train before the {name}")
            table.append(measure(name, inject, job, metrics, log))
            print(f"recovery: {name}: {table[-1]}", flush=True)
    finally:
        subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=resume"], capture_output=True)
        subprocess.run(["scancel", job], capture_output=True)
    rows = records(metrics)
    step = step_time(rows)
    snaps = [r for r in rows if r["kind"] == "snapshot"]
    print(f"\nrecovery table (one round; median step {step * 1000:.0f} ms, snapshot every {opts.snapshot_every} steps, hang timeout {opts.hang_timeout:g} s)")
    print(f"{'failure':<12} {'detect s':>9} {'requeued s':>11} {'restarted s':>12} {'back s':>8} {'replayed':>9} {'lost s':>8}  rank 0 ended")
    for r in table:
        print(
            f"{r.failure:<12} {r.detect_s:>9.1f} {r.requeued_s:>11.1f} {r.restarted_s:>12.1f} {r.back_s:>8.1f} {r.replayed:>9d} {r.lost_s:>8.1f}"
            f"  {r.how_it_ended}"
        )
    starts = [r.back_s - r.restarted_s for r in table]
    print(
        "  seconds after the failure: detect, rank 0 ended; requeued, the step ended and the job was requeued; restarted, its script "
        "started again; back, it trained again.\n"
        f"  restarted - requeued is Slurm's (here at least cred_expire=10 s, until the old job credential expires); back - restarted is "
        f"the trainer's start (imports, rendezvous, the snapshot, the first step): {min(starts):.1f}-{max(starts):.1f} s"
    )
    if snaps:
        stall = statistics.median(r["stall_s"] for r in snaps)
        write = statistics.median(r["write_s"] for r in snaps)
        print(
            f"snapshot ({len(snaps)} in the job): training held {stall * 1000:.1f} ms median against {(stall + write) * 1000:.1f} ms for the "
            f"synchronous write it replaces ({stall / (stall + write):.2f}x); 50 M parameters: bench/bench_snapshot.py"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
