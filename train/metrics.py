"""Human log lines and the JSON-lines metrics file (rank 0), flushed as they are written."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class RankLog:
    """Prints `[rank R/W] message`; `main_only` lines come from rank 0 alone.

    Each record goes out in one write(2): ranks (torchrun's workers, srun's tasks) share one stdout
    pipe, and print() writes the text and its newline separately when output is unbuffered
    (PYTHONUNBUFFERED, as in the image), so two ranks' records could land on one line. One write of
    a line under PIPE_BUF (4 KiB) is atomic on a pipe."""

    def __init__(self, rank: int, world_size: int, stream: TextIO = sys.stdout) -> None:
        self.rank, self.world_size, self.stream = rank, world_size, stream

    def __call__(self, message: str, main_only: bool = False) -> None:
        if main_only and self.rank != 0:
            return
        line = f"[rank {self.rank}/{self.world_size}] {message}\n"
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
            self.stream.write(line)
            return
        self.stream.flush()  # anything printed before goes first
        data = line.encode(errors="replace")
        while data:
            data = data[os.write(fd, data) :]


class MetricsFile:
    """Appends one JSON object a line; a no-op where no path is given (and on ranks other than 0).
    Opened at the first record, so a run refused at set-up (a bad setting for the model) leaves no file.
    Writes take a lock: the snapshot writer's thread records its snapshots while training records steps."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self._handle: TextIO | None = None
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        with self._lock:
            if self.path is None:
                return
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
            self._handle.write(json.dumps({"time": round(time.time(), 3), "kind": kind, **fields}) + "\n")
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
            self._handle, self.path = None, None
