"""The preflight's verdict, one definition: the closing line rank 0 prints, and the same read back from its
JSON record (`preflight.json` in the run folder) by tools that should not parse log text (make smoke).
Standard library only: host tooling imports it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def verdict_line(failures: Sequence[str], warnings: Sequence[str], seconds: float) -> str:
    """`preflight: PASS in 6.4 s`, `preflight: PASS with 1 warning (...) in 7.1 s`, `preflight: FAILED (2 problems) in 9.0 s`."""
    verdict = f"FAILED ({plural(len(failures), 'problem')})" if failures else "PASS"
    if warnings:
        verdict += f" with {plural(len(warnings), 'warning')} (--preflight-strict makes them failures)"
    return f"preflight: {verdict} in {seconds:.1f} s"


def read_verdict(path: Path) -> tuple[bool, str] | None:
    """(passed, the verdict line) from a preflight's JSON record, or None where there is none or it is unreadable
    (the preflight did not get as far as writing it)."""
    try:
        record = json.loads(path.read_text())
        return bool(record["ok"]), verdict_line(record["failures"], record["warnings"], float(record["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# A node check's status: "fail" ends the job (the node is the cause), "warn" is said and the job trains, "skip" says
# what could not be read here and why.
STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True, kw_only=True)
class NodeCheck:
    """One row of the preflight's node checks: what one node showed for one check, against its threshold.

    The record that crosses from the preflight to the job's program (preflight.json's `node_checks`; the program's
    `preflight` decision carries the failing ones as `failed_checks`): a later step that swaps a failing node for a
    spare reads `node`, `check`, `value` and `threshold` from here, never from the FAIL line's words."""

    node: str  # Slurm's name of the node (the rank's host)
    check: str  # the check's name, as the table in docs/preflight.md names it (shm-free, row-remap, h2d, ...)
    value: str  # what the node showed, with its unit ("1.0 MiB", "GPU 3: pending", "41.2 GB/s")
    threshold: str  # what passes ("free >= 1.0 GiB", "no pending or failed remap", ">= 48 GB/s")
    status: str  # one of STATUSES
    device: str = ""  # the GPU(s) or NIC(s) the value is about, empty for the node as a whole
    action: str = ""  # what to do when the status is not ok

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    def line(self) -> str:
        """The one line a FAIL or WARN says: node, check, value, threshold, what to do."""
        where = f" {self.device}" if self.device else ""
        return f"node {self.node}: {self.check}{where}: {self.value} (threshold: {self.threshold}): {self.action}"

    def key(self) -> dict[str, str]:
        """The fields a job's decision record keeps of a failed check."""
        return {"node": self.node, "check": self.check, "value": self.value, "threshold": self.threshold, "device": self.device}


def read_node_checks(path: Path) -> list[NodeCheck]:
    """The node checks of a preflight's JSON record, [] where there are none or it is unreadable."""
    try:
        rows = json.loads(path.read_text()).get("node_checks") or []
        names = {f.name for f in fields(NodeCheck)}
        return [NodeCheck(**{k: str(v) for k, v in row.items() if k in names}) for row in rows]
    except (OSError, ValueError, TypeError, AttributeError):
        return []
