"""`ddpack export RUN|SWEEP... --csv FILE | --summary FILE | --tensorboard DIR`: a run's records out of ddpack.

- `--csv FILE`: one row a metrics record (progress and eval; start and end too, for their step and time), with the
  run's identity (`run`, `run_dir`, `job_id`), its sweep values (`value.NAME`) and tags (`tag.KEY`) on every row, so
  one file of many runs can be grouped by them in pandas, a spreadsheet or a tracker; `segment` (a restart or requeue
  starts the next) and `redone` (a later segment resumed from a snapshot below this record's step, so the step was
  trained again: keep the rows where it is False for one value a step).
- `--summary FILE`: one row a run: its identity, values and tags, and how it ended (`ddpack compare`'s outcome:
  state, step, last train and eval loss, median samples/s and MFU, wall time, restarts), and each eval metric the
  run recorded at its last value (`eval.NAME`: the bundled trainer's, `run.eval_done`'s, Lightning's, HF's).
- `--tensorboard DIR`: one folder a run, named by its values (`lr=3e-4,seed=1`; a run that is no sweep point by its
  name), holding TensorBoard event files of the same scalars the trainer's --tensorboard writes (train/loss, ...,
  eval/...), each at its global step and time. Written with the `tensorboard` package's own event writer (pip
  install tensorboard), never by hand.

A sweep's folder stands for its points. Files are written whole (a temporary name, then a rename).
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.run_json import read_record
from ddpack.private_files import write_atomically

TRAIN_SCALARS = ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mfu")  # train.metrics.TensorBoardScalars'
KINDS = ("start", "progress", "eval", "end")


def runs_of(folders: list[Path]) -> list[Path]:
    """The runs the folders name: a sweep's folder is its points."""
    from ddpack.jobs.sweep_points import is_sweep, point_dirs

    return [point for folder in folders for point in (point_dirs(folder) if is_sweep(folder) else [folder])]


def identity(run_dir: Path) -> dict[str, Any]:
    """The columns every row of a run carries: its name, folder, newest job, sweep values and tags."""
    record = read_record(run_dir)
    job = record.last_job
    sweep = record.sweep or {}
    return {
        "run": record.name,
        "run_dir": str(run_dir),
        "job_id": job.job_id if job else None,
        "sweep": sweep.get("dir"),
        "point": sweep.get("index"),
        **{f"value.{name}": value for name, value in (sweep.get("values") or {}).items()},
        **{f"tag.{key}": value for key, value in record.tags.items()},
    }


def scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) or value is None


def records_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics records of KINDS, in order, their scalar fields only (a list such as rank_step_s is left out)."""
    from ddpack.jobs.run_metrics import read_metrics
    from train import run_folder

    if not (run_dir / run_folder.METRICS).is_file():  # still queued, or a program that writes no records
        return []
    records, _ = read_metrics(run_dir / run_folder.METRICS)
    return with_segments([{key: value for key, value in record.items() if scalar(value)} for record in records])


def with_segments(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of KINDS, each with its `segment` (1, 2, ...: a start opens one, as `ddpack status` numbers them) and
    `redone`: whether a later segment resumed from a step below this record's, so its step was trained again and the
    later record of that step is the one the run kept (a tracker that wants one value a step drops the redone ones)."""
    number, numbered = 0, []
    for record in records:
        if record.get("kind") == "start" or number == 0:
            number += 1
        numbered.append((number, record))
    resumed = {n: r.get("global_step") for n, r in numbered if r.get("kind") == "start" and isinstance(r.get("global_step"), int)}
    rows = []
    for n, record in numbered:
        later = [step for segment, step in resumed.items() if segment > n]
        step = record.get("global_step")
        redone = isinstance(step, int) and bool(later) and step > min(later)
        if record.get("kind") in KINDS:
            rows.append({**record, "segment": n, "redone": redone})
    return rows


def csv_text(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV, the columns in the order they first appear."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def export_csv(runs: list[Path], path: Path) -> int:
    """One row a record of every run; the rows written."""
    rows = [{**identity(run_dir), **record} for run_dir in runs for record in records_of(run_dir)]
    write_atomically(path, csv_text(rows), mode=0o600)
    return len(rows)


def export_summary(runs: list[Path], path: Path) -> int:
    """One row a run: identity and how it ended."""
    from dataclasses import asdict

    from ddpack.jobs.compare import outcome, slurm_said
    from ddpack.jobs.metrics_scan import digest_stale

    digest_stale(runs)  # the first read of big files, on every core
    said = slurm_said(runs)  # one squeue and one sacct for all
    rows = []
    for run_dir in runs:
        ended = asdict(outcome(run_dir, curves=False, asked=said(run_dir))[0])  # a digest: no curves
        evals = ended.pop("evals")  # each eval metric a column of its own (eval.val_acc): a spreadsheet ranks by any
        rows.append({**identity(run_dir), **ended, **{f"eval.{name}": value for name, value in evals.items()}})
    write_atomically(path, csv_text(rows), mode=0o600)
    return len(rows)


def folder_name(run_dir: Path) -> str:
    """A run's TensorBoard folder: its values (lr=3e-4,seed=1) for a sweep's point, else its name; safe as one name."""
    record = read_record(run_dir)
    values = (record.sweep or {}).get("values")
    name = ",".join(f"{key}={value}" for key, value in values.items()) if values else record.name
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)[:200] or "run"


def export_tensorboard(runs: list[Path], folder: Path) -> list[Path]:
    """Each run's scalars as TensorBoard event files under `folder`, one folder a run; the folders written."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise HostError(
            "export --tensorboard needs the Python package 'tensorboard', which is not installed here; pip install tensorboard", code=2
        ) from None
    written = []
    names: dict[str, int] = {}
    for run_dir in runs:
        name = folder_name(run_dir)
        names[name] = names.get(name, 0) + 1
        target = folder / (name if names[name] == 1 else f"{name}.{names[name]}")  # two runs of the same values: both kept
        target.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(target))
        for record in records_of(run_dir):
            kind, step = record.get("kind"), record.get("global_step")
            if kind == "progress":
                tags = {f"train/{key}": record[key] for key in TRAIN_SCALARS if isinstance(record.get(key), int | float)}
            elif kind == "eval":
                tags = {f"eval/{key}": value for key, value in record.items()
                        if key not in ("kind", "time", "epoch", "global_step") and isinstance(value, int | float) and not isinstance(value, bool)}  # fmt: skip
            else:
                continue
            if tags and isinstance(step, int):
                values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in tags.items()]
                writer.add_event(Event(wall_time=float(record.get("time") or 0), step=step, summary=Summary(value=values)))
        writer.close()
        written.append(target)
    return written
