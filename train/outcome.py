"""The end-of-run record: how a rank's run ended, as one JSON line that tools read instead of log text.

Every rank of `python -m train` prints it last, `[rank R/W] ddpack-end {...}`, whatever the ending (done,
stopped by a signal, bad input, a failure, a hang the watchdog ended), and rank 0 appends the same fields to
the metrics file as its `end` record (not for bad input: a run refused before it trained leaves no file).
`make smoke`, the tests and the benches read it with `read_ends`; the job templates decide from the exit
status alone, which the record repeats. A standby of in-process recovery that leaves without taking a rank (the run
ended, the job fell back, the store went, its warm-up failed) prints `[standby] ddpack-standby-end {...}` instead
(`StandbyEnd`, exit 0: the run goes on without it), which the job's program reads and says in one line naming the
standby, its node and why. Standard library only: host tooling imports this module (it never imports torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

MARK = "ddpack-end "
OUTCOMES = ("done", "stopped", "bad-input", "failed", "hung")
# A failed end's reason when --recovery fell back to a restart of every rank (what follows says why).
RECOVERY_IMPOSSIBLE = "in-process recovery impossible: "
# Why a failed rank ended, as a field the job's program decides from (enroot/ddpack_step.py: which node crashed,
# whether recovery fell back), never from the words of `reason`:
#   peer: a collective failed (a peer died, or did not answer in time): this rank crashed nothing;
#   recovery-fallback: in-process recovery could not replace the dead (the job restarts every rank): nor did this one;
#   counted-dead: the standbys judged this rank dead (its heartbeat stopped: frozen, or suppressed by someone who can
#     reach the store) and gave its place to a standby; it was alive, so its node is not blamed for a crash;
#   own: this rank's own error (an OOM, a failed write, a user's exception).
CAUSES = ("peer", "recovery-fallback", "counted-dead", "own")


@dataclass(frozen=True)
class RunEnd:
    """One rank's ending. Positions count as the progress lines count them (epochs from 1)."""

    rank: int
    world_size: int
    host: str
    outcome: str  # one of OUTCOMES
    exit_code: int  # what the process exits with (0, 1, 2, 124, 128+N)
    global_step: int | None = None  # steps finished (the snapshot's step for a stop)
    total_steps: int | None = None
    epoch: int | None = None
    step_in_epoch: int | None = None
    steps_per_epoch: int | None = None
    checksum: str | None = None  # done: this rank's final parameter checksum (every rank's must agree)
    final_loss: float | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    signal: str | None = None  # stopped: SIGTERM / SIGUSR1
    snapshot: str | None = None  # stopped: the durable snapshot to resume from
    reason: str | None = None  # bad-input, failed, hung: the one line that says why
    cause: str | None = None  # failed: one of CAUSES
    forensics: str | None = None  # hung: the evidence folder

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r} is not one of {OUTCOMES}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"cause {self.cause!r} is not one of {CAUSES}")

    def fields(self) -> dict[str, object]:
        """The fields that are set, for the metrics file's `end` record."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def line(self) -> str:
        """The record as printed; a reason is cut so that the line stays one atomic write (under 4 KiB)."""
        record = self.fields()
        if isinstance(record.get("reason"), str):
            record["reason"] = record["reason"][:1000]
        return MARK + json.dumps(record, separators=(",", ":"))


_NAMES = {f.name for f in fields(RunEnd)}


def _marked(text: str, mark: str) -> Iterator[Any]:
    """The JSON after `mark` on each line of `text` that has it, in order (any prefix before the mark; a line whose
    JSON does not parse is skipped)."""
    for line in text.splitlines():
        at = line.find(mark)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(mark) :])
        except ValueError:
            continue
        yield record


def read_ends(text: str) -> list[RunEnd]:
    """Every end record in `text` (a job log, a container's output, ranks interleaved, any prefix
    before the mark), in order. A line that is not one is ignored; fields a newer trainer adds are too."""
    ends = []
    for record in _marked(text, MARK):
        if isinstance(record, dict) and {"rank", "world_size", "host", "outcome", "exit_code"} <= record.keys():
            ends.append(RunEnd(**{k: v for k, v in record.items() if k in _NAMES}))
    return ends


def checksums(text: str) -> list[str]:
    """The final parameter checksums of the ranks that finished, in the order their records appear."""
    return [end.checksum for end in read_ends(text) if end.outcome == "done" and end.checksum is not None]


STANDBY_MARK = "ddpack-standby-end "
# Why a standby left without taking a rank, as a field the job's program reads (enroot/ddpack_step.py):
#   run-over: the run ended (its ranks said `closed`): it was not needed;
#   fallback: the job falls back to a restart of every rank (the standbys' decision says why);
#   store-gone: the job's store does not answer (its host, rank 0's node, lost; or the run ended before it was warm);
#   cannot-start: its warm-up failed (an import, the device): the run goes on with one standby fewer.
STANDBY_REASONS = ("run-over", "fallback", "store-gone", "cannot-start")


@dataclass(frozen=True)
class StandbyEnd:
    """A standby's leaving, the last line it prints when it never took a rank."""

    member: str  # its name in the job (s<n>), or "standby" before it has one
    host: str
    why: str  # one of STANDBY_REASONS
    detail: str  # the one line that says it
    exit_code: int = 0  # what the process exits with: 0, the run goes on (or ended) without it

    def __post_init__(self) -> None:
        if self.why not in STANDBY_REASONS:
            raise ValueError(f"why {self.why!r} is not one of {STANDBY_REASONS}")

    def line(self) -> str:
        """The record as printed, the detail made one line and cut so that the line stays one atomic write."""
        record = {**asdict(self), "detail": " ".join(self.detail.split())[:1000]}
        return STANDBY_MARK + json.dumps(record, separators=(",", ":"))


def read_standby_ends(text: str) -> list[StandbyEnd]:
    """Every standby's leaving record in `text`, in order (lines that are not one are ignored)."""
    ends = []
    for record in _marked(text, STANDBY_MARK):
        try:
            ends.append(StandbyEnd(**{k: record[k] for k in ("member", "host", "why", "detail", "exit_code")}))
        except (ValueError, KeyError, TypeError):
            continue
    return ends
