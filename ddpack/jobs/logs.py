"""`ddpack logs`: a run's job logs, Slurm's output in its folder, shown whole or followed.

Its jobs' logs are `logs/slurm-<job>.out` in the run folder (a requeue appends to its job's log; a resubmit is a new
job and a new log), so `logs` shows a run's whole history and `logs -f` follows it across requeues, ending with the
job's state (from `ddpack status`: Slurm and the run's records, never the log's sentences).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TextIO

from ddpack.errors import HostError
from ddpack.jobs import slurm_cli
from ddpack.jobs.run_json import read_record
from ddpack.jobs.slurm_cli import ENDED
from ddpack.jobs.status import run_status

POLL_STATE_S = 2.0  # how often `logs -f` asks Slurm for the job's state (the log itself is read every poll)


# srun --label's prefix (the per-task template labels a program of your own): the task number, right-aligned.
SRUN_LABEL = re.compile(r"^\s*(\d+): ")


def rank_filter(line: str, rank: int | None) -> bool:
    """Rank `rank`'s line: the bundled trainer's "[rank R/W]", or srun's "R: " label on any program's."""
    if rank is None or line.startswith(f"[rank {rank}/") or f"] [rank {rank}/" in line:
        return True
    label = SRUN_LABEL.match(line)
    return label is not None and int(label.group(1)) == rank


def whole_lines(log: Path) -> tuple[list[str], int]:
    """A log's whole lines (a line still being written is shown once it is whole) and their length in bytes."""
    data = log.read_bytes() if log.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    return complete.decode(errors="replace").splitlines(keepends=True), len(complete)


def log_lines(run_dir: Path, rank: int | None) -> list[dict[str, object]]:
    """Each job's whole lines (rank `rank`'s alone, when given), in submission order: what `logs --json` prints."""
    jobs = []
    for job in read_record(run_dir).jobs:
        log = job.log_path(run_dir)
        lines = [line.rstrip("\n") for line in whole_lines(log)[0] if rank_filter(line, rank)]
        jobs.append({"job_id": job.job_id, "attempt": job.attempt, "how": job.how, "log": str(log), "lines": lines})
    return jobs


def print_logs(run_dir: Path, rank: int | None, out: TextIO | None = None) -> dict[str, int]:
    """Every job's log in submission order (to `out`, else this moment's stdout); {log: bytes shown}, where a follow
    goes on from."""
    out = out or sys.stdout
    record = read_record(run_dir)
    shown = {}
    for job in record.jobs:
        log = job.log_path(run_dir)
        if len(record.jobs) > 1:
            out.write(f"==> job {job.job_id} (attempt {job.attempt}, {job.how}) <==\n")
        lines, size = whole_lines(log)
        out.writelines(line for line in lines if rank_filter(line, rank))
        shown[str(log)] = size
    out.flush()
    return shown


def follow(run_dir: Path, rank: int | None, out: TextIO | None = None, poll_s: float = 0.5, settle_s: float | None = None) -> int:
    """Show the logs, then follow the newest job's until the job has ended (an ended state that held `settle_s`,
    slurm_cli.SETTLE_S: across its requeues; at once when the job's own last decision ended it), and one more read of
    its log; returns 0 when it COMPLETED, else the state's exit status (EXIT_FOR_STATE)."""
    settle_s = slurm_cli.SETTLE_S if settle_s is None else settle_s
    out = out or sys.stdout
    shown = print_logs(run_dir, rank, out)
    record = read_record(run_dir)
    job = record.last_job
    if job is None:
        raise HostError(f"{run_dir} has no job to follow", code=2)
    log = job.log_path(run_dir)
    offset, ended_since, next_check, state, for_good, last_pass = shown.get(str(log), 0), None, 0.0, "", False, False
    while True:
        if log.exists() and log.stat().st_size > offset:
            with log.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines(keepends=True):
                if rank_filter(line, rank):
                    out.write(line)
            out.flush()
        if last_pass:
            out.write(f"ddpack logs: job {job.job_id} {state}\n")
            out.flush()
            return slurm_cli.exit_for(state)
        now = time.monotonic()
        if now >= next_check:
            status = run_status(run_dir)
            state, for_good = status.state, status.ended_for_good
            next_check = now + POLL_STATE_S
            ended_since = (ended_since or now) if state in ENDED else None
        last_pass = ended_since is not None and (now - ended_since >= settle_s or for_good)
        time.sleep(0 if last_pass else poll_s)
