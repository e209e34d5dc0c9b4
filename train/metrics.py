"""Human log lines and the JSON-lines metrics file (rank 0), flushed as they are written."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class RankLog:
    """Prints `[rank R/W] message`; `main_only` lines come from rank 0 alone."""

    def __init__(self, rank: int, world_size: int, stream: TextIO = sys.stdout) -> None:
        self.rank, self.world_size, self.stream = rank, world_size, stream

    def __call__(self, message: str, main_only: bool = False) -> None:
        if main_only and self.rank != 0:
            return
        print(f"[rank {self.rank}/{self.world_size}] {message}", file=self.stream, flush=True)


class MetricsFile:
    """Appends one JSON object a line; a no-op where no path is given (and on ranks other than 0)."""

    def __init__(self, path: str | None) -> None:
        self._handle = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def write(self, kind: str, **fields: Any) -> None:
        if self._handle is None:
            return
        self._handle.write(json.dumps({"time": round(time.time(), 3), "kind": kind, **fields}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
