"""The preflight's verdict, one definition: the closing line rank 0 prints, and the same read back from its
JSON record (`preflight.json` in the run folder) by tools that should not parse log text (make smoke).
Standard library only: host tooling imports it."""

from __future__ import annotations

import json
from collections.abc import Sequence
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
