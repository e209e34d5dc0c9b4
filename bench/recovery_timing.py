"""One recovery measurement for the benchmarks (bench_goodput.py, bench_recovery.py): a failure injected at a
known wall-clock time -> training again, read from rank 0's metrics file and, as a check from outside, from the
job's log as it grows.

From the metrics records (rank 0 stamps each with the wall clock, the injection's clock on the test cluster):
- back: the failure -> the first progress record of the next start (the segment that a `start` record opens after
  the failure). Not the first progress record written after the failure: the failing job writes its own next
  record milliseconds later, which made `make bench-goodput` print "back 0.0 s" (issue 42; bench_recovery had the
  same mistake until dc3ebc3);
- detect: the failure -> the failing segment's end record (rank 0 knew and stopped training). A rank 0 killed
  outright (its node lost: Slurm SIGKILLs the step) writes none: detect is then None with the reason, never NaN;
- replayed: steps trained before the failure that the next start trains again (it resumes from the snapshot).
From the job log, whose lines carry no times (each is timed when a poll first sees it, every 0.1 s):
- decided: the failure -> the template's decision (requeue the job, or restart the step in this allocation);
- log back: the failure -> the first progress line after that decision (the restart's first progress line).
  Rank 0 writes its progress line and its record together, so the two backs agree within a poll or two;
  a wide gap means one of them timed something else.

A figure that comes out zero, negative or not a number is an ImplausibleRecovery, not a row of a table: such a
figure timed the wrong record, and the model (ddpack/jobs/goodput_model.py) would otherwise be fed it.

Why in bench/ and not in ddpack/jobs/run_metrics.py: it reads a run folder after the fact for `make report`
(strict: a damaged file is the user's error, exit 2). This reads one while the job still writes it, against a
failure the benchmark injected and timed; only the benchmarks (and their tests) need that. It shares
segments' one definition of a segment (split_segments: a `start` record opens one).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ddpack.jobs.run_metrics import Segment, split_segments  # noqa: E402
from testbed.slurm_jobs import PROGRESS_LINE  # noqa: E402  (rank 0's progress line in a job log)

# The templates' decision after a failed step (enroot/ddpack-job.sh): requeue the job, or restart the step here.
DECISIONS = ("requeueing job", "restarting it in this allocation")
NO_END = "no end record: rank 0 was killed outright (its node lost, or the step SIGKILLed) before it could write one"
POLL_S = 0.1


class ImplausibleRecovery(ValueError):
    """A recovery figure that cannot be true (zero, negative, not a number): it timed the wrong record."""


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """Seconds after the failure; None where the run left nothing to time (see `ended`, `NO_END`)."""

    back_s: float  # the next start's first progress record
    detect_s: float | None  # the failing segment's end record; None when rank 0 wrote none
    ended: str  # how rank 0 ended ("failed (exit 1)"), or why there is no end record
    replayed: int  # steps trained before the failure and again after it
    resumed_at: int  # the global step of the next start's first progress record
    decided_s: float | None = None  # the template's decision in the job log (polled)
    log_back_s: float | None = None  # the first progress line after that decision (polled)

    @property
    def log_agrees(self) -> bool:
        """The records' back and the log's agree within a third (the issue's bar for a measurement to quote)."""
        return self.log_back_s is not None and abs(self.log_back_s - self.back_s) <= max(self.back_s, self.log_back_s) / 3


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rank 0's records so far: none before the file exists, a torn last line (being written) skipped."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if number != len(lines):
                raise
    return rows


def _plausible(name: str, seconds: float) -> float:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ImplausibleRecovery(
            f"{name} = {seconds} s after the failure: a recovery takes a positive, finite time; it timed the wrong record"
        )
    return seconds


def _failing_segment(segments: list[Segment], failed_at: float) -> int:
    """The segment that was training at the failure: the last one that began at or before it."""
    began = [i for i, s in enumerate(segments) if s.began is not None and s.began <= failed_at]
    if not began:
        raise ImplausibleRecovery(f"no segment had begun by the failure at {failed_at:.3f}: the records are from another run or clock")
    return began[-1]


def recovery_from_records(records: list[dict[str, Any]], failed_at: float, *, no_end: str = NO_END) -> Recovery | None:
    """The recovery from a failure at `failed_at` (time.time()), or None while the next start has not trained yet.
    `no_end` says why rank 0 left no end record, where the caller knows better than NO_END."""
    segments = split_segments(records)
    if not segments:
        return None
    failing = _failing_segment(segments, failed_at)
    if failing + 1 >= len(segments) or not segments[failing + 1].progress:
        return None
    old, new = segments[failing], segments[failing + 1]
    first = new.progress[0]
    back = _plausible("back (the next start's first progress record)", first["time"] - failed_at)
    detect = None
    if old.end is not None:
        detect = _plausible("detect (rank 0's end record)", old.end["time"] - failed_at)
        if detect > back:
            raise ImplausibleRecovery(f"detect {detect:.3f} s is after back {back:.3f} s: the end record is not the failing segment's")
    before = max((r["global_step"] for r in old.progress), default=0)
    return Recovery(
        back_s=back,
        detect_s=detect,
        ended=f"{old.end['outcome']} (exit {old.end['exit_code']})" if old.end else no_end,
        replayed=max(0, before - (first["global_step"] - 1)),
        resumed_at=first["global_step"],
    )


@dataclass
class LogWatch:
    """The job log after the failure, polled: when the template's decision and then the restart's first progress
    line first appear. `skip` is the log's length (characters) before the failure: lines from before it never count."""

    skip: int
    decided_at: float | None = None
    back_at: float | None = None
    _decision_end: int = 0

    def see(self, text: str, now: float) -> None:
        after = text[self.skip :]
        if self.decided_at is None:
            ends = [at + len(d) for d in DECISIONS if (at := after.find(d)) >= 0]
            if not ends:
                return
            self.decided_at, self._decision_end = now, min(ends)
        if self.back_at is None and PROGRESS_LINE.search(after, self._decision_end):
            self.back_at = now


def log_length(log: Path) -> int:
    return len(log.read_text(encoding="utf-8", errors="replace")) if log.exists() else 0


def follow(metrics: Path, log: Path, failed_at: float, log_skip: int, *, timeout: float, no_end: str = NO_END) -> Recovery:
    """Poll the metrics file and the job log every POLL_S until the next start has trained in both; the recovery
    with the log's figures. TimeoutError after `timeout` seconds (the caller says which job and where its log is)."""
    watch = LogWatch(skip=log_skip)
    deadline = time.monotonic() + timeout
    while True:
        watch.see(log.read_text(encoding="utf-8", errors="replace") if log.exists() else "", time.time())
        found = recovery_from_records(read_metrics(metrics), failed_at, no_end=no_end)
        if found is not None and watch.back_at is not None:
            return replace(
                found,
                decided_s=_plausible("decided (the template's decision in the log)", watch.decided_at - failed_at),
                log_back_s=_plausible("log back (the restart's first progress line)", watch.back_at - failed_at),
            )
        if time.monotonic() > deadline:
            seen = (
                "trained again in its records only"
                if found
                else ("decided, not trained again" if watch.decided_at else "no decision in the log")
            )
            raise TimeoutError(f"the job did not train again within {timeout:.0f} s of the failure ({seen})")
        time.sleep(POLL_S)
