"""The node-hour ledger: for a run (and a sweep), the node-hours its jobs were allocated and what they bought.

An allocation is one start of the job's script on its nodes: from its `start` record (decisions.jsonl) to the
decision that gave the nodes back (the step-end that ended the job or requeued it), else Slurm's cancel or time
limit (the log's line; without one, a TIMEOUT's start plus its time limit), else the allocation's last record. Its
node count is the start record's node list, times the share of each node a sweep's point held where it shared them
(its CPUs or GPUs over the node's, recorded at submit: submit_checks.NodeShare); whole nodes count 1. Each
allocation's span is cut into parts that follow each other, so the parts add up to the allocation by construction:

- startup: the start to the first training record (staging the image, unpacking it, the launch), less
- preflight: the preflight's own seconds (preflight.json), ending at its record;
- kept: training time whose steps the run kept: up to the last snapshot a later segment resumed from (the whole of
  the last segment of a run that COMPLETED);
- redone: training time after that snapshot, whose steps a later segment did again;
- preemptions, hangs, failures: from a segment's last record to the decision that stopped it (the stop, the save,
  a hang until the watchdog named it), by the decision's reason;
- restarts: from such a decision to the next segment's first record in the same allocation (a restart in place);
- not completed: the last segment of a run that did not complete (its steps bought no finished run);
- shutdown: after the last decision (or training's last record) to the allocation's end;
- unrecorded: an allocation whose program wrote no training records (its time cannot be split further).

Beside them, never in the sum (no nodes are held): the wait in the queue before each job's first start and the
requeue waits, from a requeue decision to the next start. A sweep adds its points' ledgers; the node-hours of a
point that ended and did not complete are its failed points' cost (a point still waiting or training is not one).
The times are the records' (each node's clock, as the job wrote them); what Slurm does before the script's first
line (prolog) and after its last (epilog) is not seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpack.jobs.decisions import read_decisions
from ddpack.jobs.run_json import RunRecord, read_record
from ddpack.jobs.run_metrics import Segment, split_segments
from ddpack.jobs.slurm_cli import ENDED, time_limit_s
from train import run_folder

PARTS = (
    "kept",
    "redone",
    "startup",
    "preflight",
    "restarts",
    "preemptions",
    "hangs",
    "failures",
    "not_completed",
    "shutdown",
    "unrecorded",
)
STOP_PART = {"preempted": "preemptions", "hung": "hangs", "done": "shutdown"}  # any other reason: failures


@dataclass
class Allocation:
    job: str
    nodes: int
    began: float
    ended: float | None = None
    stops: list[dict[str, Any]] = field(default_factory=list)  # its step-end records, in order
    preflight_at: float | None = None


@dataclass
class Ledger:
    run_dir: str
    state: str
    allocations: list[dict[str, Any]] = field(default_factory=list)  # job, nodes, began, ended, node_hours
    node_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))  # node-seconds a part
    steps_kept: int | None = None
    steps_redone: int = 0
    preemptions: int = 0
    restarts: int = 0
    requeues: int = 0
    queue_wait_s: float = 0.0
    requeue_wait_s: float = 0.0
    failed_points: int = 0
    failed_point_node_s: float = 0.0
    note: str = ""

    @property
    def allocated_node_s(self) -> float:
        return sum(a["node_s"] for a in self.allocations)

    def to_json(self) -> dict[str, Any]:
        hours = {part: seconds / 3600 for part, seconds in self.node_s.items()}
        return {
            "run_dir": self.run_dir, "state": self.state, "allocated_node_hours": self.allocated_node_s / 3600, "node_hours": hours,
            "steps_kept": self.steps_kept, "steps_redone": self.steps_redone, "preemptions": self.preemptions,
            "restarts": self.restarts, "requeues": self.requeues, "queue_wait_s": self.queue_wait_s,
            "requeue_wait_s": self.requeue_wait_s, "failed_points": self.failed_points,
            "failed_point_node_hours": self.failed_point_node_s / 3600, "allocations": self.allocations, "note": self.note,
        }  # fmt: skip


def node_count(nodes: str, record: RunRecord) -> int:
    """The start record's node list counted (Slurm's hostlist), else the run's asked-for nodes and spares."""
    from entrypoint.hostlist import HostlistError, expand_hostlist

    try:
        names = expand_hostlist(nodes) if nodes else []
    except HostlistError:
        names = []
    return len(names) or int(record.settings.get("nodes") or 1) + int(record.settings.get("spares") or 0)


def node_fraction(record: RunRecord) -> float:
    """The share of each node the run held: 1 for whole nodes (--exclusive), a sharing sweep point's own otherwise
    (its GPUs over the node's where it asks GPUs, else its CPUs over the node's: submit_checks.NodeShare)."""
    share = record.settings.get("share") or {}
    try:
        if share.get("gpus") and share.get("node_gpus"):
            return min(1.0, float(share["gpus"]) / float(share["node_gpus"]))
        return min(1.0, float(share["cpus"]) / float(share["node_cpus"])) if share else 1.0
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 1.0


def allocations_of(entries: list[dict[str, Any]], record: RunRecord) -> list[Allocation]:
    """Each start of the job's script, closed by the decision that gave its nodes back (requeue, end, completed)."""
    found: list[Allocation] = []
    for entry in entries:
        kind, when = entry.get("kind"), float(entry["time"])
        if kind == "start":  # an allocation still open here was killed without a decision: run_ledger ends it at its last record
            found.append(Allocation(job=str(entry.get("job")), nodes=node_count(str(entry.get("nodes") or ""), record), began=when))
        elif found and found[-1].ended is None:
            if kind == "preflight":
                found[-1].preflight_at = when
            elif kind == "step-end":
                found[-1].stops.append(entry)
                if entry.get("verdict") in ("requeue", "end", "completed"):
                    found[-1].ended = when
    return found


def resumed_at(segment: Segment, step: int) -> float:
    """The time of the segment's last record at or before `step` (the snapshot a later segment resumed from)."""
    times = [r["time"] for r in [*([segment.start] if segment.start else []), *segment.progress, *segment.snapshots]
             if isinstance(r.get("global_step"), int) and r["global_step"] <= step]  # fmt: skip
    began = segment.began if segment.began is not None else 0.0
    return min(max(times, default=began), segment.ended or began)


def last_step(segment: Segment) -> int | None:
    steps = [r["global_step"] for r in [*segment.progress, *segment.snapshots, *([segment.end] if segment.end else [])]
             if isinstance(r.get("global_step"), int)]  # fmt: skip
    return max(steps) if steps else None


def run_ledger(run_dir: Path, state: str | None = None, segments: list[Segment] | None = None) -> Ledger:
    """The run's ledger (module docstring); `state` is its final state (ddpack status's, asked when not given);
    `segments` its metrics' (run_metrics.read_run's) when the caller read them already, else read here."""
    from ddpack.jobs.run_metrics import read_metrics

    record = read_record(run_dir)
    if state is None:
        from ddpack.jobs.status import run_status

        state = run_status(run_dir).state
    ledger = Ledger(run_dir=str(run_dir), state=state)
    entries = read_decisions(run_dir)
    allocations = allocations_of(entries, record)
    if not allocations:
        ledger.note = "no start records (decisions.jsonl): a job of an older ddpack, or one not started yet"
        return ledger
    metrics = run_dir / run_folder.METRICS
    if segments is None:
        try:
            segments = split_segments(read_metrics(metrics)[0]) if metrics.is_file() else []
        except Exception:  # a damaged metrics file: the allocations alone
            segments = []
    segments = [s for s in segments if s.began is not None]
    preflight_s = preflight_seconds(run_dir)
    share = node_fraction(record)
    for index, alloc in enumerate(allocations):
        following = allocations[index + 1].began if index + 1 < len(allocations) else None
        mine = [s for s in segments if s.began is not None and s.began >= alloc.began and (following is None or s.began < following)]
        if alloc.ended is None:  # no decision gave the nodes back (Slurm's cancel, the time limit): Slurm's end of it
            last = max([*(s.ended for s in mine if s.ended is not None), *(float(e["time"]) for e in alloc.stops), alloc.began])
            alloc.ended = slurm_end(run_dir, record, alloc, following, state if following is None else None) or last
        parts = split_allocation(alloc, mine, segments, state == "COMPLETED", preflight_s)
        span, held = alloc.ended - alloc.began, alloc.nodes * share  # a point sharing its nodes is charged its share
        for part, seconds in parts.items():
            ledger.node_s[part] += seconds * held
        ledger.allocations.append({"job": alloc.job, "nodes": alloc.nodes, "share": share, "began": alloc.began, "ended": alloc.ended,
                                   "node_s": span * held, "node_hours": span * held / 3600})  # fmt: skip
        ledger.preemptions += sum(stop.get("reason") == "preempted" for stop in alloc.stops)
        ledger.restarts += sum(stop.get("verdict") == "restart" for stop in alloc.stops)
        ledger.requeues += sum(stop.get("verdict") == "requeue" for stop in alloc.stops)
        if index + 1 < len(allocations) and alloc.stops and alloc.stops[-1].get("verdict") == "requeue":
            ledger.requeue_wait_s += max(0.0, allocations[index + 1].began - alloc.ended)
    for job in record.jobs:  # each job's wait in the queue before its first start
        first = next((a.began for a in allocations if a.job == job.job_id), None)
        if first is not None:
            ledger.queue_wait_s += max(0.0, first - job.submitted)
    for i, segment in enumerate(segments[:-1]):
        resume, reached = segments[i + 1].start.get("global_step") if segments[i + 1].start else None, last_step(segment)
        if isinstance(resume, int) and reached is not None:
            ledger.steps_redone += max(0, reached - resume)
    if segments:  # a completed run keeps every step it reached; another, those up to its last segment's start
        ledger.steps_kept = last_step(segments[-1]) if state == "COMPLETED" else (segments[-1].start or {}).get("global_step")
    return ledger


def slurm_end(run_dir: Path, record: RunRecord, alloc: Allocation, following: float | None, state: str | None) -> float | None:
    """When Slurm took back an allocation its job never gave back (scancel, the time limit, a preemption): the time of
    Slurm's own cancel line in the job's log after the allocation began; without one, for the run's last allocation
    ended TIMEOUT, its start plus the job's time limit (Slurm kills it then); else None (its last record answers)."""
    from ddpack.jobs.status import slurm_cancels

    job = next((job for job in reversed(record.jobs) if job.job_id == alloc.job), None)
    if job is None:
        return None
    for _, cancel in slurm_cancels(job.log_path(run_dir), job.job_id):
        if cancel.when is not None and cancel.when >= alloc.began - 1 and (following is None or cancel.when <= following):
            return max(cancel.when, alloc.began)
    limit = time_limit_s(job.changes.get("time_limit") or record.settings.get("time_limit"))
    return alloc.began + limit if state == "TIMEOUT" and limit is not None else None


def preflight_seconds(run_dir: Path) -> float:
    try:
        return float(json.loads((run_dir / run_folder.PREFLIGHT).read_text()).get("seconds") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def split_allocation(alloc: Allocation, mine: list[Segment], every: list[Segment], completed: bool, preflight_s: float) -> dict[str, float]:
    """The allocation's span cut into PARTS (seconds), in order, so they add up to it."""
    parts = dict.fromkeys(PARTS, 0.0)
    end = alloc.ended if alloc.ended is not None else alloc.began
    if not mine:
        parts["unrecorded"] = end - alloc.began
        return parts
    cursor = alloc.began
    stops = list(alloc.stops)
    for number, segment in enumerate(mine):
        began = min(max(segment.began or cursor, cursor), end)
        gap = began - cursor
        if number == 0:
            held = min(gap, preflight_s) if alloc.preflight_at is not None and alloc.preflight_at <= began else 0.0
            parts["preflight"] += held
            parts["startup"] += gap - held
        else:
            parts["restarts"] += gap
        finished = min(max(segment.ended or began, began), end)
        following = every[every.index(segment) + 1] if every.index(segment) + 1 < len(every) else None
        resume = following.start.get("global_step") if following is not None and following.start else None
        if isinstance(resume, int):
            kept_until = min(max(resumed_at(segment, resume), began), finished)
            parts["kept"] += kept_until - began
            parts["redone"] += finished - kept_until
        elif following is None:
            parts["kept" if completed else "not_completed"] += finished - began
        else:  # a later segment that names no step it resumed from: counted as kept
            parts["kept"] += finished - began
        cursor = finished
        stop = next((s for s in stops if float(s["time"]) >= finished), None)
        if stop is not None and (number + 1 == len(mine) or float(stop["time"]) <= (mine[number + 1].began or end)):
            stops.remove(stop)
            until = min(float(stop["time"]), end)
            parts[STOP_PART.get(str(stop.get("reason")), "failures")] += max(0.0, until - cursor)
            cursor = max(cursor, until)
    parts["shutdown"] += max(0.0, end - cursor)
    return parts


def sweep_ledger(folder: Path) -> Ledger:
    """The sweep's points' ledgers added; a point that ended and did not complete is a failed point, its node-hours
    their cost (one still waiting or training is not)."""
    from ddpack.jobs.sweep import sweep_status

    status = sweep_status(folder)
    points = [(point["index"], point["state"], run_ledger(Path(point["run_dir"]), point["state"])) for point in status["points"]]
    return added_ledgers(folder, status["state"], points)


def added_ledgers(folder: Path, state: str, points: list[tuple[int, str, Ledger]]) -> Ledger:
    """A sweep's ledger from its points' own (index, state, ledger): compare SWEEP has them from its one read of each
    point's metrics."""
    total = Ledger(run_dir=str(folder), state=state)
    for index, point_state, one in points:
        point = {"index": index, "state": point_state}
        for part, seconds in one.node_s.items():
            total.node_s[part] += seconds
        total.allocations += [{**a, "point": point["index"]} for a in one.allocations]
        for name in ("steps_redone", "preemptions", "restarts", "requeues", "queue_wait_s", "requeue_wait_s"):
            setattr(total, name, getattr(total, name) + getattr(one, name))
        total.steps_kept = (total.steps_kept or 0) + (one.steps_kept or 0) if point["state"] == "COMPLETED" else total.steps_kept
        if point["state"] != "COMPLETED" and point["state"] in ENDED:  # a point waiting or training has not failed
            total.failed_points += 1
            total.failed_point_node_s += one.allocated_node_s
    return total


NAMES = {"kept": "steps kept", "redone": "steps redone after a restart", "startup": "startup (staging, unpack, launch)",
         "preflight": "preflight", "restarts": "restarts in place", "preemptions": "preemptions (stop and save)",
         "hangs": "hangs until detected", "failures": "failures (until decided)", "not_completed": "a run that did not complete",
         "shutdown": "shutdown", "unrecorded": "ran, steps not recorded"}  # fmt: skip


def render(ledger: Ledger, what: str) -> str:
    """The ledger as lines: the allocation, then each part with its share (the parts add up to it), then the waits."""
    total = ledger.allocated_node_s
    lines = [f"node-hours of {what}: {total / 3600:.3f} allocated over {len(ledger.allocations)} allocation(s)"
             + (f" ({ledger.note})" if ledger.note else "")]  # fmt: skip
    for part in PARTS:
        seconds = ledger.node_s[part]
        if seconds:
            lines.append(f"  {NAMES[part]:<36} {seconds / 3600:9.3f}  {100 * seconds / total if total else 0:5.1f} %")
    counts = [f"steps kept {ledger.steps_kept if ledger.steps_kept is not None else '-'}", f"redone {ledger.steps_redone}",
              f"preemptions {ledger.preemptions}", f"restarts in place {ledger.restarts}", f"requeues {ledger.requeues}"]  # fmt: skip
    if ledger.failed_points:
        counts.append(f"failed points {ledger.failed_points} ({ledger.failed_point_node_s / 3600:.3f} node-hours)")
    lines.append("  " + ", ".join(counts))
    lines.append(
        f"  not allocated: {ledger.queue_wait_s / 60:.1f} min queued before starts, {ledger.requeue_wait_s / 60:.1f} min waiting after requeues"
    )
    return "\n".join(lines)
