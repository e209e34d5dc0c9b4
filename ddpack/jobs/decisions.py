"""The job's decision records, `decisions.jsonl` in the run folder: one JSON object a line, appended by the job's
program (enroot/ddpack_records.py `write_record`: every record's time, kind, job, slurm_job and restart, then the fields
of its kind: start, placement, staging, preflight, step-end, keep-out, recovery). One reader for every verb that reads them
(`status`, the ledger of `report` and `compare`), never the log's sentences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train import run_folder


def read_decisions(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records in the order the job wrote them; a line that is not one (torn: the job was killed while it
    wrote it) is skipped. None at all: a job of a ddpack older than its records, or one not started yet."""
    try:
        lines = (run_dir / run_folder.DECISIONS).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
            float(entry["time"])
            str(entry["kind"])
        except (ValueError, KeyError, TypeError):
            continue
        found.append(entry)
    return found
