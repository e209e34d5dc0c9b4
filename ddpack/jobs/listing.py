"""`ddpack ls`: every run under the runs folder with its state and progress, filtered and sorted, a sweep before its
points.

A settled run answers from its summary (status.SUMMARY: its metrics and logs unread); the others are asked of Slurm
in one squeue and one sacct call for all (status.asked_for), and a live run's metrics are glanced at (their head and
tail), never read whole: the file grows while ls reads it. `ddpack status RUN` reads a run in full.
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.find_runs import list_runs
from ddpack.jobs.run_metrics import metric_of
from ddpack.jobs.status import SUMMARY_FIELDS, MetricsTail, asked_for, keep_summary, read_summary, run_status, tail_from
from ddpack.jobs.sweep_points import read_sweep, sweep_state
from train import run_folder


def list_rows(runs: Path, *, ask_slurm: bool = True) -> list[dict[str, Any]]:
    """One row per run (status --json's names): run_dir, name, job_id, state, step, total_steps, loss, created, tags.
    One squeue call for all the runs still to settle; an ended run's summary (summary.json) answers for it, its
    metrics and logs unread. Without `ask_slurm` (completion) no Slurm command runs: a run without a summary has state
    None. A sweep is a row of its own (with `points`), before its points' rows (with `sweep`, its folder, and
    `values`)."""
    found = list_runs(runs)
    summaries = {str(run_dir): read_summary(run_dir, record) for run_dir, record in found}
    unsettled = [record.last_job for run_dir, record in found if summaries[str(run_dir)] is None]
    asked = asked_for(unsettled) if ask_slurm else None  # one squeue and one sacct for every run, not one each
    rows: list[dict[str, Any]] = []
    sweeps: dict[str, dict[str, Any]] = {}
    for run_dir, record in found:
        job = record.last_job
        known = summaries[str(run_dir)]
        if known is None and asked is not None:
            answer = asked(job)  # a live run (squeue lists it) is glanced at: its metrics' head and tail, not the whole
            live = answer is not None and answer.queue.listed
            now = run_status(run_dir, answer, records=glance_metrics(run_dir / run_folder.METRICS) if live else None, logs=not live)
            keep_summary(run_dir, now)
            known = {key: getattr(now, key) for key in SUMMARY_FIELDS}
        known = known or dict.fromkeys(SUMMARY_FIELDS)
        row = {
            "run_dir": str(run_dir),
            "name": record.name,
            "job_id": job.job_id if job else None,
            **{key: known.get(key) for key in ("state", "step", "total_steps", "loss")},
            "evals": known.get("evals") or {},
            "created": record.created,
            "tags": record.tags,
            "note": record.note,
        }
        if record.sweep:
            folder = record.sweep["dir"]
            if folder not in sweeps:
                try:
                    data = read_sweep(Path(folder))
                except Exception:  # a sweep record not the user's own: its points are listed, it is not
                    data = None
                if data is not None:
                    sweeps[folder] = {"run_dir": folder, "name": data["name"], "job_id": data.get("job_id"), "state": None,
                                      "step": None, "total_steps": None, "loss": None, "evals": {}, "created": data.get("created", record.created),
                                      "tags": data.get("tags", {}), "note": data.get("note"), "points": len(data["points"])}  # fmt: skip
                    rows.append(sweeps[folder])
            row.update(sweep=folder, values=record.sweep["values"])
        rows.append(row)
    for folder, row in sweeps.items():
        states = [point["state"] for point in rows if point.get("sweep") == folder]
        row["state"] = sweep_state(states) if all(states) else None
    return rows


SORT_KEYS = ("created", "name", "state", "step", "loss")


def pick_rows(rows: list[dict[str, Any]], *, states: tuple[str, ...] = (), name: str | None = None, since: float | None = None,
              tags: dict[str, str] | None = None, sort: str = "created", reverse: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """ls's filters (each must hold: a state of `states`, a name matching the glob `name`, made at `since` or after,
    every tag of `tags`) and order (`sort`, one of SORT_KEYS or an eval metric some run recorded, eval.NAME too; runs
    with no value for it last). A sweep's points are filtered as runs, and ordered the same way under their sweep; a
    sweep is listed, before its points, when any of its points is."""

    def keeps(row: dict[str, Any]) -> bool:
        return ((not states or row["state"] in states) and (name is None or fnmatch(row["name"], name) or fnmatch(Path(row["run_dir"]).name, name))
                and (since is None or row["created"] >= since)
                and all(row["tags"].get(key) == value for key, value in (tags or {}).items()))  # fmt: skip

    if sort not in SORT_KEYS and rows and all(metric_of({"evals": row.get("evals") or {}}, sort) is None for row in rows):
        metrics = sorted({name for row in rows for name in row.get("evals") or {}})
        raise HostError(
            f"--sort {sort}: expected one of {', '.join(SORT_KEYS)}, or an eval metric a run recorded ({', '.join(metrics) or 'none yet'})",
            2,
        )

    def order(row: dict[str, Any]) -> tuple[bool, Any]:
        value = row.get(sort) if sort in SORT_KEYS else metric_of({"evals": row.get("evals") or {}}, sort)
        return (value is None, value if value is not None else 0)

    def ordered(found: list[dict[str, Any]]) -> list[dict[str, Any]]:  # those with no value last, whichever way round
        return sorted([r for r in found if not order(r)[0]], key=order, reverse=reverse) + [r for r in found if order(r)[0]]

    points: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if "sweep" in row and keeps(row):
            points.setdefault(row["sweep"], []).append(row)
    top = [row for row in rows if "sweep" not in row and (row["run_dir"] in points if "points" in row else keeps(row))]
    if sort in SORT_KEYS:
        top.sort(key=order, reverse=reverse)
    else:
        top = ordered(top)
    return [
        item
        for row in top
        for item in [row, *(ordered(points.get(row["run_dir"], [])) if sort not in SORT_KEYS else points.get(row["run_dir"], []))]
    ]


def render_list(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run: name, newest job, state, progress, tags."""
    lines = []
    for row in rows:
        progress = f"step {row['step']}/{row['total_steps'] or '?'}" if row["step"] is not None else "-"
        if "points" in row:
            progress = f"a sweep of {row['points']} points"
        name = (
            f"  {Path(row['run_dir']).name} " + " ".join(f"{k}={v}" for k, v in row["values"].items())
            if "sweep" in row
            else Path(row["run_dir"]).name
        )
        tags = "  " + " ".join(f"#{k}={v}" for k, v in row["tags"].items()) if row.get("tags") else ""
        lines.append(f"{name:40} job {row['job_id'] or '-':>8}  {row['state'] or '-':10} {progress}{tags}")
    return lines


GLANCE_BYTES = 64 * 1024  # what ls reads of a live run's metrics: its head and its tail


def glance_metrics(metrics: Path) -> MetricsTail:
    """A live run's records for `ls` (its state is squeue's): the last records from the file's tail, and the run's
    first start from its head where the tail holds no start; never the whole file, which grows while ls reads it. The
    segment count, progress count and eval metrics are the glance's (an eval before the tail is not seen), not the
    run's: `ddpack status RUN` reads the whole file."""
    try:
        with metrics.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size <= 2 * GLANCE_BYTES:
                return tail_from(handle.read())
            head = handle.read(GLANCE_BYTES)
            handle.seek(size - GLANCE_BYTES)
            tail = handle.read(GLANCE_BYTES)
    except OSError:
        return MetricsTail()
    records = tail_from(tail[tail.find(b"\n") + 1 :])  # its first line is a part of one
    if not records.starts:
        records.starts = tail_from(head[: head.rfind(b"\n") + 1]).starts[:1]
        records.ends = [(index + len(records.starts), end) for index, end in records.ends]
    return records


def since_time(text: str) -> float:
    """--since: 30m, 6h, 2d (ago), or a date (2026-11-26, 2026-11-26T10:00) in this host's time zone."""
    if found := re.fullmatch(r"(\d+)([mhd])", text):
        return time.time() - int(found.group(1)) * {"m": 60, "h": 3600, "d": 86400}[found.group(2)]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise HostError(f"--since {text}: expected 30m, 6h, 2d, or a date such as 2026-11-26 or 2026-11-26T10:00", code=2) from None
