"""`ddpack status`: a run's state, segments, progress and ETA, from Slurm and the run folder (many runs at once, ls and
a sweep's status: asked_for, and an ended run's summary; `ddpack ls` itself is ddpack.jobs.listing).

The state comes from `squeue` (which keeps an ended job for MinJobAge), then `sacct` where the cluster keeps
accounting, then the run folder's own records: run.json's cancels, Slurm's own `*** JOB … CANCELLED ***` line in
the job's log, the trainer's end record and the job's decisions (decisions.jsonl, which enroot/ddpack_records.py
writes). No sentence of ddpack's in a job log is read: rewording one changes nothing here. An squeue that fails or
no longer lists the job never loses a run: the folder still says what happened, and `state_from` says who answered.

The metrics file can hold hundreds of thousands of progress records: they are counted, not parsed; only the
start, end and snapshot records and the last progress records are read as JSON.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from ddpack.jobs import run_metrics, slurm_cli
from ddpack.jobs.decisions import read_decisions
from ddpack.jobs.run_json import RunRecord, read_record
from ddpack.jobs.run_metrics import KEEP_PROGRESS, Segment  # a digest keeps as many as status parses (tail_of)
from train import run_folder
from train.metrics import format_duration

# Slurm's own line when it ends a job's script: scancel, the time limit, or a requeue (which is no ending at all).
CANCELLED_LINE = re.compile(r"\*\*\* JOB (\d+) ON \S+ CANCELLED AT (\S+)( DUE TO TIME LIMIT| DUE TO JOB REQUEUE)?")
# The one line for a job with no records of its decisions: status says so, and reads no sentence of its log instead.
UNRECORDED = (
    "job {jobs} wrote no decision records (" + run_folder.DECISIONS + "): a job of a ddpack older than them, or one that "
    "could not write its run folder; its starts and decisions are unknown, its state is Slurm's and its metrics'"
)
T = TypeVar("T")
FINAL_VERDICTS = ("completed", "end")  # a step-end's verdicts after which the job starts nothing again (enroot VERDICTS)


@dataclass(frozen=True, kw_only=True)
class Status:
    run_dir: str
    name: str
    job_id: str | None
    attempt: int
    state: str
    state_from: str
    note: str
    step: int | None
    total_steps: int | None
    loss: float | None
    samples_per_s: float | None
    eta_s: float | None
    slowest_rank: int | None
    slowest_step_s: float | None
    progress_records: int
    updated: float | None
    segments: list[dict[str, Any]]  # each Segment's row (run_metrics.Segment.row)
    outcome: dict[str, Any] | None
    image: str | None
    sqsh: str | None
    unrecorded: list[str] = field(default_factory=list)  # the run's jobs that wrote no decision records (decisions.jsonl)
    evals: dict[str, float] = field(default_factory=dict)  # each eval metric's last value: what ls --sort ranks by
    final: bool = False  # the newest job's own last word, after its last start, was a decision nothing follows (completed, end)
    recovery: dict[str, Any] | None = None  # what a rank's death does: the job's newest `recovery` record, else submit's plan

    @property
    def ended(self) -> bool:
        return self.state in slurm_cli.ENDED

    @property
    def ended_for_good(self) -> bool:
        """Ended, and by the job's own last decision: no requeue can follow, so a watch need not wait for one."""
        return self.ended and self.final

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# --------------------------------------------------------------------------- the run folder's records


@dataclass
class MetricsTail:
    starts: list[dict[str, Any]] = field(default_factory=list)
    ends: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (segment index, end record)
    progress: list[dict[str, Any]] = field(default_factory=list)  # the last KEEP_PROGRESS of the last segment
    progress_count: int = 0
    evals: dict[str, float] = field(default_factory=dict)  # each eval metric's last value (compare.eval_metrics)


def tail_of(segments: list[Segment], progress_count: int | None = None) -> MetricsTail:
    """What read_metrics_tail finds, from a run's segments already read (run_metrics.read_run, or a digest's, whose
    `progress_count` counted them all): compare and export read each metrics file once, for the status, the curves and
    the ledger alike."""
    records = MetricsTail()
    offset = 0 if segments and segments[0].start is not None else -1  # records before the first start: segment -1
    for index, segment in enumerate(segments):
        if segment.start is not None:
            records.starts.append(segment.start)
        if segment.end is not None:
            records.ends.append((index + offset, segment.end))
        records.progress_count += len(segment.progress)
        records.evals.update(run_metrics.eval_metrics(segment.evals))
    records.progress = list(segments[-1].progress[-KEEP_PROGRESS:]) if segments else []
    records.progress_count = records.progress_count if progress_count is None else progress_count  # a digest's: counted in full
    return records


def read_metrics_tail(metrics: Path) -> MetricsTail:
    """The records status needs, without parsing every progress line (a long run writes 100,000 of them)."""
    try:
        return tail_from(metrics.read_bytes())
    except OSError:
        return MetricsTail()


def tail_from(data: bytes) -> MetricsTail:
    """The records status needs from the metrics' bytes: start and end records parsed, progress lines counted and the
    last KEEP_PROGRESS of the last segment parsed."""
    records = MetricsTail()
    last_progress: list[bytes] = []
    for line in data.splitlines():
        if b'"kind": "progress"' in line:
            records.progress_count += 1
            last_progress.append(line)
            if len(last_progress) > 2 * KEEP_PROGRESS:
                del last_progress[:KEEP_PROGRESS]
            continue
        if b'"kind": "start"' not in line and b'"kind": "end"' not in line and b'"kind": "eval"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line: the run was killed while writing it
        if record.get("kind") == "start":
            records.starts.append(record)
            last_progress = []
        elif record.get("kind") == "end":
            records.ends.append((len(records.starts) - 1, record))
        elif record.get("kind") == "eval":
            records.evals.update(run_metrics.eval_metrics([record]))
    for line in last_progress[-KEEP_PROGRESS:]:
        try:
            records.progress.append(json.loads(line))
        except ValueError:
            continue
    return records


@dataclass(frozen=True)
class JobEvent:
    kind: str  # "start" (a start of the job's script), "step-end" (the job's decision after a step), "cancel" (Slurm's)
    job_id: str
    text: str
    when: float | None = None  # a record's time, or a cancel's (Slurm's, in the cluster's local time)
    verdict: str = ""  # a step-end's: completed, end, requeue or restart (enroot/ddpack_records.py VERDICTS)
    log_at: int | None = None  # a start's: the job log's size when it began (where Slurm's lines after it are)

    @property
    def starts_segment(self) -> bool:
        """A decision after which training starts again (a requeue, a restart in place)."""
        return self.kind == "step-end" and self.verdict in ("requeue", "restart")


def decision_records(run_dir: Path, record: RunRecord) -> dict[str, list[JobEvent]]:
    """Each job's starts and step-end decisions from decisions.jsonl, the records the job's program writes
    (enroot/ddpack_records.py write_record), keyed by the job as ddpack knows it (a sweep's point as <array>_<index>)."""
    recorded: dict[str, list[JobEvent]] = {}
    ids = {job.job_id for job in record.jobs}
    for entry in read_decisions(run_dir):
        kind, when = entry["kind"], float(entry["time"])
        job = str(entry.get("job")) if str(entry.get("job")) in ids else str(entry.get("slurm_job"))
        if kind == "start":
            log_at = entry.get("log_at") if isinstance(entry.get("log_at"), int) else None
            recorded.setdefault(job, []).append(JobEvent("start", job, f"restart {entry.get('restart', 0)}", when, log_at=log_at))
        elif kind == "step-end":
            text, verdict = str(entry.get("text") or entry.get("verdict")), str(entry.get("verdict") or "")
            recorded.setdefault(job, []).append(JobEvent("step-end", job, text, when, verdict))
    return recorded


def job_events(run_dir: Path, record: RunRecord, *, logs: bool = True) -> tuple[list[JobEvent], list[str]]:
    """Each job's starts and decisions (its records), job by job in submission order, with Slurm's own cancels of its
    script placed after the start they ended; and the jobs that wrote no records (a job of a ddpack older than them).

    Slurm's cancel (scancel, the time limit, a preemption) is in no record of the job's: Slurm writes it into the job's
    log as `*** JOB <id> ON <node> CANCELLED AT <time> ***` and kills the script before it can say anything. That line
    is read, never a sentence of ddpack's, and only where a start of the job has no decision after it (the script
    ended without deciding): a job that decided after every start is not read again. A cancel goes after the last
    start that began before it in the log (each start record's `log_at`, the log's size then); a start recorded
    without one (an older job) is placed by its time (Slurm's is the cluster's local time, taken to be this host's).
    A job with no log never started (Slurm opens it as the script starts): waiting, it has written no records yet.
    Without `logs` (ls of a job squeue lists: Slurm has cancelled nothing of it that counts) no log is read."""
    recorded = decision_records(run_dir, record)
    events: list[JobEvent] = []
    unrecorded = []
    for job in record.jobs:
        mine = recorded.get(job.job_id, [])
        if not mine and job.log_path(run_dir).exists():  # no log: Slurm never started it (pending, or cancelled so)
            unrecorded.append(job.job_id)
        # A start with no decision after it: the script was ended from outside (by Slurm), or it is running still.
        undecided = any(
            a.kind == "start" and (b is None or b.kind == "start") for a, b in zip(mine, [*mine[1:], None][: len(mine)], strict=True)
        )
        cancels = slurm_cancels(job.log_path(run_dir), job.job_id) if logs and (undecided or not mine) else []
        for event in mine:
            if event.kind == "start":
                before = [(at, c) for at, c in cancels if ended_before(at, c, event)]
                events += [c for _, c in before]
                cancels = [item for item in cancels if item not in before]
            events.append(event)
        events += [c for _, c in cancels]
    return events, unrecorded


def ended_before(at: int, cancel: JobEvent, start: JobEvent) -> bool:
    """Whether Slurm's cancel, `at` bytes into the job's log, came before `start` did."""
    if start.log_at is not None:
        return at < start.log_at
    return cancel.when is not None and start.when is not None and cancel.when + 1 < start.when


def slurm_cancels(log: Path, job_id: str) -> list[tuple[int, JobEvent]]:
    """Slurm's cancel lines in a job's log (not its requeue's, which ends nothing), each with where it is in the log:
    found by Slurm's own marker, the rest of the log unparsed."""
    try:
        data = log.read_bytes()
    except OSError:
        return []
    found, at = [], data.find(b"*** JOB ")
    while at >= 0:
        end = data.find(b"\n", at)
        line = data[data.rfind(b"\n", 0, at) + 1 : len(data) if end < 0 else end].decode(errors="replace")
        cancel = CANCELLED_LINE.search(line)
        if cancel and cancel.group(3) != " DUE TO JOB REQUEUE":
            when = parse_time(cancel.group(2), "%Y-%m-%dT%H:%M:%S")
            found.append((at, JobEvent("cancel", job_id, "TIMEOUT" if cancel.group(3) else "CANCELLED", when)))
        at = data.find(b"*** JOB ", at + 8)
    return found


def parse_time(text: str | None, layout: str) -> float | None:
    """Seconds since the epoch from a log's time (one with no zone is the cluster's local time); None when absent."""
    if not text:
        return None
    try:
        return datetime.strptime(text, layout).timestamp()
    except ValueError:
        return None


def segments_of(records: MetricsTail, events: list[JobEvent]) -> list[Segment]:
    """Each start record of the metrics is a segment; the job's decision before it says why. A program that writes no
    metrics (a user's own) still has the job's records: each start of the job's script and each restart in place. A
    segment begins at its start record's time (else the job's record of it) and ends at its end record's (else at
    Slurm's cancel, when Slurm cancelled it)."""
    ends = dict(records.ends)
    starting = [e.text for e in events if e.starts_segment]
    if records.starts:
        segments = [
            Segment(
                start=start,
                end=ends.get(i),
                why="submitted" if i == 0 else (starting[i - 1] if i - 1 < len(starting) else "started again (a resubmit)"),
            )
            for i, start in enumerate(records.starts)
        ]
        if len(starting) >= len(records.starts):  # the job started training again; its first record is to come
            segments.append(Segment(why=f"{starting[-1]} (starting)"))
        return with_cancel_times(segments, events)
    segments = []
    why = "submitted"
    for event in events:
        if event.kind == "start" or event.verdict == "restart":
            segments.append(Segment(recorded_at=event.when, why=why if event.kind == "start" else event.text))
            why = "started again (a resubmit)"
        elif event.starts_segment:
            why = event.text
    return with_cancel_times(segments, events)


def with_cancel_times(segments: list[Segment], events: list[JobEvent]) -> list[Segment]:
    """A segment with no end of its own that Slurm cancelled (scancel, the time limit) ends at Slurm's time: the first
    cancel after it began and before the next segment did."""
    cancels = [e.when for e in events if e.kind == "cancel" and e.when is not None]
    for i, segment in enumerate(segments):
        following = next((s.began for s in segments[i + 1 :] if s.began is not None), None)
        if segment.end is None and segment.began is not None:
            inside = [t for t in cancels if t >= segment.began - 1 and (following is None or t <= following)]
            if inside:
                segment.cancelled_at = inside[0]
    return segments


# --------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class Asked:
    """What Slurm already said of many runs' jobs in one call each (ddpack ls): squeue's answer for this job, and
    sacct's answers for all (empty where the cluster keeps no accounting), so a run's state needs no call of its own."""

    queue: slurm_cli.QueueAnswer
    accounting: dict[str, tuple[str, str]]


def state_of(
    job_id: str | None, record: RunRecord, records: MetricsTail, events: list[JobEvent], asked: Asked | None = None
) -> tuple[str, str, str]:
    """(state, who said so, a note) for the run's newest job: Slurm (squeue, then sacct), then the run folder's
    records (run.json's cancels, Slurm's own cancel line, the trainer's end record, the job's decisions)."""
    if job_id is None:
        return "UNKNOWN", "run folder", "no job was submitted for this run"
    ran_before = any(e.kind == "start" and e.job_id == job_id for e in events)
    decisions = [e for e in events if e.kind == "step-end" and e.job_id == job_id]
    queue = asked.queue if asked else slurm_cli.queue_state(job_id)
    note = ""
    if queue.listed:
        state, ours = queue.state, slurm_cli.ddpack_state(queue.state)
        if ours == "REQUEUED" or (state == "PENDING" and ran_before):
            return "REQUEUED", "squeue", queue.reason
        if ours != state:  # COMPLETING is RUNNING, NODE_FAIL is FAILED, ...: Slurm's own word in the note
            return ours, "squeue", state.lower()
        return state, "squeue", queue.reason if state == "PENDING" else ""
    if queue.failed:
        note = f"{queue.failed}; state from the run folder"
    accounted = asked.accounting.get(job_id) if asked else slurm_cli.accounting_state(job_id)
    if accounted and accounted[0]:
        return slurm_cli.ddpack_state(accounted[0]), "sacct", note
    for event in reversed(record.events):
        if event.get("kind") == "cancel" and event.get("job_id") == job_id:
            return "CANCELLED", "run.json", note or "ddpack cancel"
    mine = [e for e in events if e.job_id == job_id and e.kind in ("start", "cancel")]
    if mine and mine[-1].kind == "cancel":  # Slurm ended the script, and it did not start again after
        return mine[-1].text, "job log", note
    last_segment = len(records.starts) - 1
    end = next((e for i, e in reversed(records.ends) if i == last_segment), None)
    if end is not None and end.get("outcome") == "done":
        return "COMPLETED", "end record", note
    if decisions and decisions[-1].verdict == "completed":
        return "COMPLETED", "job records", note
    if decisions and decisions[-1].verdict == "end":
        return "FAILED", "job records", note or decisions[-1].text
    if queue.failed:  # the job may be between a stop and its requeue: only a verdict above settles it
        return "UNKNOWN", "run folder", note
    if end is not None:
        return "FAILED", "end record", f"the last segment ended {end.get('outcome')} (exit {end.get('exit_code')})"
    return "FAILED", "run folder", "Slurm no longer lists the job and the run folder has no end record"


def recovery_of(run_dir: Path, record: RunRecord) -> dict[str, Any] | None:
    """Which recovery the run has, and why: the job's own newest `recovery` record (what it resolved on its nodes,
    enroot/ddpack_training.py), else what submit planned (run.json's settings), else None (a run of a ddpack older
    than both)."""
    recorded = [entry for entry in read_decisions(run_dir) if entry["kind"] == "recovery"]
    found = recorded[-1] if recorded else (record.settings or {}).get("recovery")
    if not isinstance(found, dict) or found.get("mode") not in ("in-process", "restart"):
        return None
    return {"mode": found["mode"], "standbys": found.get("standbys"), "why": str(found.get("why") or ""),
            **({"on_spares": True} if found.get("on_spares") is True else {}), "from": "job" if recorded else "submit"}  # fmt: skip


def run_status(run_dir: Path, asked: Asked | None = None, records: MetricsTail | None = None, *, logs: bool = True) -> Status:
    """The run's status; `records` are its metrics' when the caller read them already (compare, ls's glance: listing.glance_metrics); without
    `logs` its job logs are not read for Slurm's cancel lines (ls of a job squeue lists)."""
    record = read_record(run_dir)
    records = read_metrics_tail(run_dir / run_folder.METRICS) if records is None else records
    events, unrecorded = job_events(run_dir, record, logs=logs)
    job = record.last_job
    state, state_from, note = state_of(job.job_id if job else None, record, records, events, asked)
    segments = segments_of(records, events)
    newest = [e for e in events if job is not None and e.job_id == job.job_id and e.kind in ("start", "step-end", "cancel")]
    final = bool(newest) and newest[-1].kind == "step-end" and newest[-1].verdict in FINAL_VERDICTS
    last = records.progress[-1] if records.progress else None
    total = records.starts[-1].get("total_steps") if records.starts else None
    end = records.ends[-1][1] if records.ends and records.ends[-1][0] == len(records.starts) - 1 else None
    step = (end or last or {}).get("global_step")
    rank_steps = (last or {}).get("rank_step_s") or []
    slowest = max(range(len(rank_steps)), key=lambda r: rank_steps[r]) if rank_steps else None
    return Status(
        run_dir=str(run_dir),
        name=record.name,
        job_id=job.job_id if job else None,
        attempt=job.attempt if job else 0,
        state=state,
        state_from=state_from,
        note=note,
        step=step,
        total_steps=total,
        loss=(last or {}).get("loss"),
        samples_per_s=(last or {}).get("samples_per_s"),
        eta_s=None if state in slurm_cli.ENDED or end is not None or len(segments) > len(records.starts) else eta(records, total),
        slowest_rank=slowest,
        slowest_step_s=rank_steps[slowest] if slowest is not None else None,
        progress_records=records.progress_count,
        updated=(last or {}).get("time"),
        segments=[segment.row(number) for number, segment in enumerate(segments, 1)],
        outcome=end,
        evals=records.evals,
        image=record.image.get("ref"),
        sqsh=record.sqsh.get("path"),
        unrecorded=unrecorded,
        final=final,
        recovery=recovery_of(run_dir, record),
    )


def eta(records: MetricsTail, total: int | None) -> float | None:
    """Seconds to the last step at the segment's recent rate: the trainer's own estimate when its progress records
    carry one, else steps over time across the last records of this segment (a program of your own)."""
    if not records.progress or not total:
        return None
    last = records.progress[-1]
    if isinstance(last.get("eta_s"), int | float):
        return max(0.0, float(last["eta_s"]))
    first = records.progress[0]
    steps, seconds = last.get("global_step", 0) - first.get("global_step", 0), last["time"] - first["time"]
    if steps <= 0 or seconds <= 0:
        return None
    return max(0, total - last.get("global_step", 0)) * seconds / steps


# --------------------------------------------------------------------------- rendering


def _clock(when: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if when else "--:--:--"


def render(status: Status) -> str:
    lines = [f"run      {status.name}  ({status.run_dir})"]
    job = f"job {status.job_id} (attempt {status.attempt})" if status.job_id else "no job"
    lines.append(f"state    {status.state}  {job}, from {status.state_from}{f'; {status.note}' if status.note else ''}")
    if status.step is not None:
        share = f" ({100 * status.step / status.total_steps:.0f}%)" if status.total_steps else ""
        parts = [f"step {status.step}/{status.total_steps or '?'}{share}"]
        if status.loss is not None:
            parts.append(f"loss {status.loss:.4g}")
        if status.samples_per_s is not None:
            parts.append(f"{status.samples_per_s:,.0f} samples/s")
        if status.eta_s is not None:
            parts.append(f"ETA {format_duration(status.eta_s)}")
        if status.slowest_rank is not None and status.slowest_step_s is not None:
            parts.append(f"slowest rank {status.slowest_rank} ({1000 * status.slowest_step_s:.1f} ms/step)")
        lines.append("progress " + ", ".join(parts))
    else:
        lines.append("progress no progress records yet (still starting, or a program that writes none)")
    for segment in status.segments:
        where = f" on {','.join(segment['hosts'])}" if segment["hosts"] else ""
        start = f" from step {segment['from_step']}" if segment["from_step"] is not None else ""
        ended = f" -> {segment['outcome']}" if segment["outcome"] else ""
        span = f"{_clock(segment['began'])}-{_clock(segment['ended'])}" if segment["ended"] else _clock(segment["began"])
        lines.append(f"segment  {segment['number']} {span}{where}{start}: {segment['why']}{ended}")
    if status.outcome and status.ended:
        lines.append(
            f"end      {status.outcome.get('outcome')} at step {status.outcome.get('global_step')} (exit {status.outcome.get('exit_code')})"
        )
    if status.recovery:
        how = status.recovery
        what = (
            f"in-process, {how['standbys']} standby(s){' on the spare nodes' if how.get('on_spares') else ''}"
            if how["mode"] == "in-process"
            else "a restart of the step from its last snapshot"
        )
        lines.append(f"recovery {what} ({how['why']}{'; as submitted: the job has not said yet' if how['from'] == 'submit' else ''})")
    if status.image or status.sqsh:
        lines.append(f"image    {status.image or '-'}  {status.sqsh or ''}")
    if status.unrecorded:
        lines.append(f"records  {UNRECORDED.format(jobs=', '.join(status.unrecorded))}")
    return "\n".join(lines)


def one_line(status: Status) -> str:
    """What --watch prints per refresh when its output is not a terminal (a log, a pipe): one line, no redraws."""
    progress = f"step {status.step}/{status.total_steps or '?'}" if status.step is not None else "no progress yet"
    eta_text = f" ETA {format_duration(status.eta_s)}" if status.eta_s is not None else ""
    return (
        f"{time.strftime('%H:%M:%S')} {status.name} job {status.job_id} {status.state} {progress}{eta_text} segments {len(status.segments)}"
    )


def watch(run_dir: Path, *, interval_s: float, tty: bool, out: Any, as_json: bool = False, settle_s: float | None = None) -> Status:
    """Redraw in a terminal, one line per refresh elsewhere (one JSON object a line with as_json), until the run's
    job has ended: an ended state that held `settle_s` (slurm_cli.SETTLE_S: a requeue passes through one), as `logs -f`
    decides."""
    return watch_until_ended(
        lambda: run_status(run_dir), ended=lambda status: status.ended, full=render, line=one_line, as_dict=asdict,
        interval_s=interval_s, tty=tty, out=out, as_json=as_json, settle_s=settle_s, for_good=lambda status: status.ended_for_good,
    )  # fmt: skip


def watch_until_ended(
    read: Callable[[], T],
    *,
    ended: Callable[[T], bool],
    full: Callable[[T], str],
    line: Callable[[T], str],
    as_dict: Callable[[T], Any],
    interval_s: float,
    tty: bool,
    out: Any,
    as_json: bool,
    settle_s: float | None,
    for_good: Callable[[T], bool],
) -> T:
    """The one `--watch` loop, a run's or a sweep's: read, then redraw `full` (a terminal), write `line` (elsewhere) or
    one JSON object (as_json), until `ended` has held `settle_s` (a requeue passes through an ended state), or at once
    when `for_good` says the job's own records end it (its last decision: nothing follows); the last read."""
    settle_s = slurm_cli.SETTLE_S if settle_s is None else settle_s
    ended_since = None
    while True:
        status = read()
        if as_json:
            out.write(json.dumps(as_dict(status)) + "\n")
        elif tty:
            out.write("\x1b[H\x1b[2J" + full(status) + "\n")
        else:
            out.write(line(status) + "\n")
        out.flush()
        now = time.monotonic()
        ended_since = (ended_since or now) if ended(status) else None
        if ended_since is not None and (now - ended_since >= settle_s or for_good(status)):
            return status
        time.sleep(interval_s)


def asked_for(jobs: list[Any]) -> Any:
    """One squeue call for all of `jobs` (runs' newest Job records) and one sacct call for those squeue no longer
    lists; a function from a job to what was said of it (an Asked), or None where squeue failed (ask again, job by job)."""
    ids = [job.job_id for job in jobs if job]
    listed = slurm_cli.queue_states(ids)
    accounting = slurm_cli.accounting_states([job for job in ids if job not in listed]) if listed is not None else {}

    def asked(job: Any) -> Asked | None:
        if listed is None or job is None:
            return None
        if job.job_id in listed:
            return Asked(slurm_cli.QueueAnswer(listed=True, state=listed[job.job_id]), accounting)
        return Asked(slurm_cli.QueueAnswer(listed=False), accounting)

    return asked


SUMMARY = "summary.json"  # an ended run's state and progress, so ls and completion never read its metrics and logs again
SUMMARY_FIELDS = ("state", "state_from", "step", "total_steps", "loss", "samples_per_s", "evals")


def read_summary(run_dir: Path, record: RunRecord) -> dict[str, Any] | None:
    """The run's summary when it speaks of its newest job (a resubmit makes it stale), else None."""
    from ddpack.jobs.run_json import not_a_run_of_yours

    path = run_dir / SUMMARY
    job = record.last_job
    if job is None or not path.is_file() or not_a_run_of_yours(path) is not None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("job_id") == job.job_id and data.get("attempt") == job.attempt else None


def summarized(run_dir: Path, record: RunRecord, known: dict[str, Any]) -> dict[str, Any]:
    """A settled run's status --json object from its summary: the summary's fields, the rest empty (status RUN reads
    the whole run again: its segments, outcome, ...)."""
    from dataclasses import fields

    empty = {
        f.name: ([] if f.name in ("segments", "unrecorded") else 0 if f.name in ("attempt", "progress_records") else None)
        for f in fields(Status)
    }
    job = record.last_job
    return {**empty, "run_dir": str(run_dir), "name": record.name, "job_id": job.job_id if job else None, "attempt": job.attempt if job else 0,
            "note": "from its summary (summary.json)", "final": True, **{key: known.get(key) for key in SUMMARY_FIELDS},
            "image": record.image.get("ref"), "sqsh": record.sqsh.get("path")}  # fmt: skip


def keep_summary(run_dir: Path, status: Status) -> None:
    """Write the run's summary once its newest job has ended for good: Slurm no longer lists it and accounting, the
    job's records, its log or run.json say how it ended, so nothing but a resubmit (a new job) can change what status
    says of it. Best effort: a run folder
    that cannot be written is read in full again next time."""
    from ddpack.jobs.run_json import write_json_atomic

    if not status.ended or status.state_from in ("squeue", "run folder") or status.job_id is None:
        return  # still listed, or a guess (no record says how it ended): asked again next time
    data = {
        "job_id": status.job_id,
        "attempt": status.attempt,
        "written": time.time(),
        **{key: getattr(status, key) for key in SUMMARY_FIELDS},
    }
    try:
        write_json_atomic(run_dir / SUMMARY, data)
    except OSError:
        return
