"""The job's decision records (decisions.jsonl), as enroot/ddpack_records.py's `write_record` writes them, for tests that
fabricate a run folder: every record's own fields (RESERVED there: time, kind, job, slurm_job, restart) and the
fields its caller gives. tests/test_experiments.py holds these against what the job's program itself writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train import run_folder


def decision(when: float, kind: str, job: str = "41", *, restart: int = 0, slurm_job: str | None = None, **fields: Any) -> dict[str, Any]:
    """One record: a sweep's point is `job` <array>_<index> with its own numeric `slurm_job`."""
    return {"time": when, "kind": kind, "job": job, "slurm_job": slurm_job or job, "restart": restart, **fields}


def started(when: float, job: str = "41", *, restart: int = 0, log_at: int | None = None, **fields: Any) -> dict[str, Any]:
    """A start of the job's script (setup): its nodes, and where it began in the job's log."""
    extra = {"log_at": log_at} if log_at is not None else {}
    return decision(when, "start", job, restart=restart, nodes="ddnode[1-2]", origin="new run", **extra, **fields)


def step_end(when: float, verdict: str, text: str, job: str = "41", *, restart: int = 0, reason: str = "", code: int = 0, **fields: Any) -> dict[str, Any]:
    """The job's decision after a training step (Training.decide): completed, end, requeue or restart."""
    return decision(when, "step-end", job, restart=restart, verdict=verdict, reason=reason, exit=str(code), text=text, progress="yes", **fields)


def write_decisions(run_dir: Path, records: list[dict[str, Any]], *, append: bool = False) -> None:
    """The records as the job appends them: one JSON object a line, keys sorted (json.dumps(sort_keys=True))."""
    with (run_dir / run_folder.DECISIONS).open("a" if append else "w") as handle:
        handle.writelines(json.dumps(record, sort_keys=True) + "\n" for record in records)
