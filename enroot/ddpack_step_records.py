"""ddpack_step_records.py — what a training step wrote to the run's metrics file, read by the job program during and
after it (enroot/ddpack_training.py): whether it made progress, why in-process recovery fell back, how many ranks it
replaced in process, and where the ranks are after the last recovery. Standard library only, on the batch host; the
records' spellings are the trainer's (train/metrics.py, train/trainer.py, train/outcome.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

PROGRESS_RECORD = b'"kind": "progress"'  # train/metrics.py's progress records, as json.dumps spells them


def metrics_size(path: Path) -> int | None:
    """The metrics file's size now; None where there is none (a program of your own may write none)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


RECOVERY_RECORD = b'"kind": "recovery"'  # train/trainer.py's record of a rank replaced in process
END_RECORD = b'"kind": "end"'  # train/metrics.py's end records
RECOVERY_FALLBACK = "in-process recovery impossible: "  # train/outcome.py RECOVERY_IMPOSSIBLE: a --recovery fallback's reason


def _hosts(record: bytes) -> list[str] | None:
    """A `recovery` record's `hosts` (the ranks' hosts, in rank order); None where it has none (a record of an image
    older than the field) or does not parse."""
    with contextlib.suppress(ValueError, AttributeError):
        found = json.loads(record).get("hosts")
        if isinstance(found, list) and all(isinstance(host, str) for host in found):
            return found
    return None


def fallback_reason(end: dict) -> str | None:
    """Why in-process recovery fell back, from a rank's end record (None: it did not)."""
    reason = str(end.get("reason") or "")
    if end.get("cause", "recovery-fallback" if reason.startswith(RECOVERY_FALLBACK) else None) != "recovery-fallback":
        return None
    return reason.removeprefix(RECOVERY_FALLBACK)


@dataclasses.dataclass(frozen=True)
class StepRecords:
    """What the step wrote to the metrics file after byte `since`, read in one pass: whether it wrote progress records
    (it finished steps: "yes", "no", or "" where there is no metrics file, before or after: nothing to tell from), why
    the trainer's in-process recovery (--recovery, train/recovery.py) fell back to this restart ("": it did not; from
    the last end record that says so), how many ranks it replaced in process, and the ranks' hosts after the newest
    of those recoveries (None: none, or a record without them)."""

    progress: str
    fallback: str
    recovered: int
    hosts: list[str] | None = None

    @classmethod
    def read(cls, path: Path, since: int | None) -> StepRecords:
        progress, fallback, recovered, hosts = False, "", 0, None
        try:
            with path.open("rb") as handle:
                handle.seek(since or 0)
                for line in handle:
                    if PROGRESS_RECORD in line:
                        progress = True
                    elif RECOVERY_RECORD in line:
                        recovered, hosts = recovered + 1, _hosts(line) or hosts
                    elif END_RECORD in line:
                        with contextlib.suppress(ValueError, AttributeError):
                            fallback = fallback_reason(json.loads(line)) or fallback
        except OSError:
            return cls("" if since is None else "no", "", 0)
        return cls("yes" if progress else "no", fallback, recovered, hosts)
