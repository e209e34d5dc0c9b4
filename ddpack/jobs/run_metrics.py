"""A run folder as records: what `make report` draws, read apart from the drawing.

`metrics.jsonl` is rank 0's JSON-lines file (`start` once a segment, `progress`, `eval`, `snapshot`, `end`;
a requeued or restarted run appends another segment to the same file), `preflight.json` the preflight's
record when the job ran one (train.run_folder names both). Bad input is a HostError with exit 2: no
folder, no metrics file, or one with no records. A line that is not a record (torn: a start killed while
writing it, wherever the next start appended) is skipped with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from train import run_folder


@dataclass
class Segment:
    """One start of training (a first run, a resume after a stop, a requeue, a restart in place): its records in the
    metrics file and, where `ddpack status` knows them, why the job started it and when Slurm ended it. ddpack's one
    segment: the report draws it, `ddpack status` and `ddpack compare` sum it up (`row`)."""

    start: dict[str, Any] | None = None
    progress: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    why: str = ""  # "submitted", or the job's decision that started it (status)
    recorded_at: float | None = None  # when the job's records date this start, for a program that writes no metrics (status)
    cancelled_at: float | None = None  # Slurm's cancel (scancel, the time limit), for one without an end record (status)

    @property
    def began(self) -> float | None:
        first = self.start or (self.progress[0] if self.progress else None)
        return first.get("time") if first else self.recorded_at

    @property
    def ended(self) -> float | None:
        times = [r["time"] for r in (self.progress + self.evals + self.snapshots + ([self.end] if self.end else []))]
        return max(times) if times else self.began

    @property
    def outcome(self) -> str:
        return self.end["outcome"] if self.end else "no end record (killed, or still running)"

    def take(self, record: dict[str, Any]) -> None:
        """A record after this segment's start, filed by its kind (progress, eval, snapshot, end; another is not kept)."""
        kind = record["kind"]
        if kind == "progress":
            self.progress.append(record)
        elif kind == "eval":
            self.evals.append(record)
        elif kind == "snapshot":
            self.snapshots.append(record)
        elif kind == "end":
            self.end = record

    def row(self, number: int) -> dict[str, Any]:
        """The segment as `ddpack status` shows it (and `--json` writes it): ended at its end record, else at Slurm's
        cancel, else not yet (None: running, or unknown)."""
        start = self.start or {}
        return {
            "number": number,
            "began": self.began,
            "why": self.why,
            "ended": self.end.get("time") if self.end else self.cancelled_at,
            "hosts": sorted(set(start.get("hosts") or [])),
            "from_step": start.get("global_step"),
            "slurm_restart": start.get("slurm_restart_count"),
            "outcome": self.end.get("outcome") if self.end else None,
        }


@dataclass
class Run:
    folder: Path
    segments: list[Segment]
    preflight: dict[str, Any] | None
    warnings: list[str]

    @property
    def progress(self) -> list[dict[str, Any]]:
        return [r for s in self.segments for r in s.progress]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for s in self.segments for r in s.evals]

    @property
    def t0(self) -> float:
        return min(s.began for s in self.segments if s.began is not None)

    @property
    def last_start(self) -> dict[str, Any] | None:
        starts = [s.start for s in self.segments if s.start]
        return starts[-1] if starts else None


def metrics_path(run: Path) -> Path:
    """The run folder's metrics file; RUN may also name the file itself."""
    if run.is_file():
        return run
    if not run.is_dir():
        raise HostError(
            f"RUN={run} is not a folder; give the run folder that holds {run_folder.METRICS} (the templates' runs/<job>-<id>)", 2
        )
    path = run / run_folder.METRICS
    if not path.is_file():
        raise HostError(
            f"{run} holds no {run_folder.METRICS}; give the folder a run wrote it in (the trainer's --metrics-file), or the file itself", 2
        )
    return path


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every record; a line that is not one (torn: a start killed while writing it) is skipped with a warning."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror}", 2) from None
    records, warnings = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(metrics_record(line))
        except ValueError:
            warnings.append(torn_line(number, path))
    if not records:
        raise HostError(f"{path} has no records: the run wrote nothing yet (it stopped before its first step, or is still starting)", 2)
    return records, warnings


def metrics_record(line: str) -> dict[str, Any]:
    """The record a line of the metrics file holds; ValueError where it holds none (torn: a start killed mid-write
    leaves half a line, and the next start's records follow it). The full parse and the scan (metrics_scan) both ask."""
    record = json.loads(line)
    if not isinstance(record, dict) or "kind" not in record or "time" not in record:
        raise ValueError("not a metrics record")
    return record


def torn_line(number: int, path: Path) -> str:
    """The warning for line `number` of `path` that holds no record (metrics_record)."""
    return f"skipped line {number} of {path}: not a metrics record (torn: a start was killed while writing it)"


def split_segments(records: Iterable[dict[str, Any]]) -> list[Segment]:
    """A `start` record opens a segment; records before the first (files from older trainers) form one too."""
    segments: list[Segment] = []
    for record in records:
        if record["kind"] == "start" or not segments:
            segments.append(Segment(start=record if record["kind"] == "start" else None))
        if record["kind"] != "start":
            segments[-1].take(record)
    return segments


def read_preflight(folder: Path, warnings: list[str]) -> dict[str, Any] | None:
    """The run's preflight record, None where it ran none (or a warning where it cannot be read)."""
    preflight_file = folder / run_folder.PREFLIGHT
    if preflight_file.is_file():
        try:
            return json.loads(preflight_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            warnings.append(f"skipped {preflight_file}: not readable JSON")
    return None


def read_run(run: Path) -> Run:
    path = metrics_path(run)
    records, warnings = read_metrics(path)
    preflight = read_preflight(path.parent, warnings)
    return Run(folder=path.parent, segments=split_segments(records), preflight=preflight, warnings=warnings)


NOT_METRICS = ("kind", "time", "global_step", "epoch")  # an eval record's fields that place it, not what it measured


def eval_metrics(evals: list[dict[str, Any]]) -> dict[str, float]:
    """Each metric the run's eval records hold (any program's: the bundled trainer's, ddpack_run's eval_done, the
    Lightning and Hugging Face adapters'), at its last value: what a sweep is ranked by."""
    last: dict[str, float] = {}
    for record in evals:
        last.update({key: value for key, value in record.items()
                     if key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)})  # fmt: skip
    return last


def metric_of(row: dict[str, Any], key: str) -> Any:
    """A row's value for `key`: its own column (a swept name, state, eval_loss, ...), else its eval metric `key`
    (also written eval.KEY, for a metric whose name a column has)."""
    evals = row.get("evals") or {}
    if key in row and key != "evals":
        return row[key]
    return evals.get(key.removeprefix("eval.") if key.startswith("eval.") else key)


# --------------------------------------------------------------------------- the digest: a big file read once

DIGEST = "metrics-digest.json"  # the host's own cache beside metrics.jsonl: what compare and export --summary need of it
DIGEST_FORMAT = 1
KEEP_PROGRESS = 50  # the last progress records of each segment a digest keeps (status's rate over recent steps)


@dataclass(frozen=True, kw_only=True)
class Digest:
    """A run's metrics as `compare`, `export --summary` and the ledger need them, without every progress record: each
    segment's start, end, evals and snapshots, its first and last KEEP_PROGRESS progress records and the last one at
    or below the step the next segment resumed from (what the ledger splits at), and what needs them all (counted,
    the last train loss, the medians). Kept in DIGEST beside the metrics, so a file that has not changed since (a
    settled point of a sweep) is parsed once, ever: 20 MB of records take a second to parse, their digest a
    millisecond."""

    run: Run
    progress_count: int
    train_loss: float | None
    samples_per_s: float | None  # the median over every progress record
    mfu: float | None  # the median

    @classmethod
    def of(cls, run: Run) -> Digest:
        progress = run.progress
        losses = [r["loss"] for r in progress if r.get("loss") is not None]
        rates = [r["samples_per_s"] for r in progress if r.get("samples_per_s") is not None]
        mfus = [r["mfu"] for r in progress if r.get("mfu") is not None]
        return cls.summed(run, progress_count=len(progress), train_loss=losses[-1] if losses else None, rates=rates, mfus=mfus)

    @classmethod
    def summed(cls, run: Run, *, progress_count: int, train_loss: Any, rates: list[Any], mfus: list[Any]) -> Digest:
        """The digest from what every progress record gave (the rates and MFUs in file order, the last loss): the one
        place its medians are taken, for the full parse and the scan (metrics_scan) alike."""
        from statistics import median

        return cls(run=run, progress_count=progress_count, train_loss=train_loss, samples_per_s=median(rates) if rates else None,
                   mfu=median(mfus) if mfus else None)  # fmt: skip


def kept_records(segments: list[Segment]) -> list[dict[str, Any]]:
    """The records a digest keeps, in an order split_segments reads back into the same segments (Digest)."""
    kept: list[dict[str, Any]] = []
    for index, segment in enumerate(segments):
        following = segments[index + 1].start if index + 1 < len(segments) else None
        resume = following.get("global_step") if following else None
        below = [i for i, r in enumerate(segment.progress) if isinstance(resume, int) and isinstance(r.get("global_step"), int)
                 and r["global_step"] <= resume]  # fmt: skip
        picked = sorted({0, *range(max(0, len(segment.progress) - KEEP_PROGRESS), len(segment.progress)), *below[-1:]})
        kept += [*([segment.start] if segment.start else []), *(segment.progress[i] for i in picked if i < len(segment.progress)),
                 *segment.evals, *segment.snapshots, *([segment.end] if segment.end else [])]  # fmt: skip
    return kept


def digest_key(path: Path) -> list[int]:
    info = path.stat()
    return [DIGEST_FORMAT, info.st_size, info.st_mtime_ns, info.st_ino]
