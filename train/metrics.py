"""Human log lines and the JSON-lines metrics file (rank 0), flushed as they are written."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def start_fields(*, world_size: int, hosts: list[str], backend: str | None, global_step: int, total_steps: int | None) -> dict[str, Any]:
    """What every `start` record holds, the trainer's and ddpack_run's alike: who ran, from which step, in
    which Slurm job and restart. `make report` draws a segment from them."""
    return {
        "world_size": world_size,
        "hosts": hosts,
        "backend": backend,
        "global_step": global_step,
        "total_steps": total_steps,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "torchelastic_restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    }


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rem = divmod(seconds, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_share(fraction: float) -> str:
    """A percentage with two significant digits however small (a small model's MFU on a CPU is 0.00023%,
    not 0.00%), never in exponent notation."""
    percent = fraction * 100
    decimals = 2 if percent <= 0 else max(2, 1 - math.floor(math.log10(percent)))
    return f"{percent:.{decimals}f}%"


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


class TensorBoardScalars:
    """The metrics records' scalars as TensorBoard event files, each at its global step: loss, lr,
    grad_norm, samples/s, tokens/s, MFU, eval metrics and every rank's step time. torch's writer needs the
    tensorboard package (config.py refuses --tensorboard without it), so it is imported only when asked for."""

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory)

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        step = fields.get("global_step")
        if kind == "progress":
            for name in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mfu"):
                if fields.get(name) is not None:
                    self.writer.add_scalar(f"train/{name}", fields[name], step)
            for rank, seconds in enumerate(fields.get("rank_step_s", [])):
                self.writer.add_scalar(f"step_time_ms/rank{rank}", seconds * 1e3, step)
        elif kind == "eval":
            for name, value in fields.items():
                if name not in ("epoch", "global_step") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"eval/{name}", value, step)
        else:
            return
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def torn_tail(path: Path) -> bool:
    """Whether the file ends in the middle of a line (its writer was killed while writing it)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except OSError:
        return False


class MetricsWriteError(Exception):
    """The metrics file could not be written (a full, over-quota or read-only run folder): the run ends as failed,
    every rank within seconds, instead of a traceback that leaves its peers waiting out the collective timeout."""


class MetricsFile:
    """Appends one JSON object a line; a no-op where no path is given (and on ranks other than 0).
    Opened at the first record, so a run refused at set-up (a bad setting for the model) leaves no file.
    Writes take a lock: the snapshot writer's thread records its snapshots while training records steps.
    With `tensorboard` (a folder) the same records' scalars also go to TensorBoard event files there."""

    def __init__(self, path: str | None, tensorboard: str | None = None) -> None:
        self.path = Path(path) if path else None
        self._tensorboard_dir = tensorboard
        self._tensorboard: TensorBoardScalars | None = None
        self._handle: TextIO | None = None
        self._opening: tuple[float, str, Callable[[], dict[str, Any]]] | None = None
        self._lock = threading.Lock()

    def opening(self, kind: str, fields: Callable[[], dict[str, Any]]) -> None:
        """A record stamped now but written just before the next one, with the fields it has by then: a
        segment's `start` says what the first step learnt (the model's FLOPs), and a run refused at its
        first steps still leaves no file."""
        with self._lock:
            self._opening = (round(time.time(), 3), kind, fields)

    def write(self, kind: str, **fields: Any) -> None:
        with self._lock:
            if self._opening is not None:
                stamped, opening_kind, opening_fields = self._opening
                self._opening = None
                self._append(stamped, opening_kind, opening_fields())
            self._append(round(time.time(), 3), kind, fields)

    def _append(self, stamped: float, kind: str, fields: dict[str, Any]) -> None:
        if self._tensorboard_dir and self._tensorboard is None:
            self._tensorboard = TensorBoardScalars(self._tensorboard_dir)
        if self._tensorboard is not None:
            self._tensorboard.write(kind, fields)
        if self.path is None:
            return
        line = json.dumps({"time": stamped, "kind": kind, **fields}) + "\n"
        try:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
                if torn_tail(self.path):  # a run killed mid-write: its half line stays one line of its own
                    line = "\n" + line
            self._handle.write(line)
            self._handle.flush()
        except OSError as exc:
            # What did not reach the file is dropped from the buffer: the next write (the end record, where the disk
            # has room again) must not fail on it, nor write half a line twice.
            self._drop_handle()
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise MetricsWriteError(
                f"the {kind} record could not be written to {self.path}: {why}; make room or fix its permissions, then resume"
            ) from None

    def _drop_handle(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            with contextlib.suppress(OSError):  # the buffered remainder cannot be written either: let it go
                handle.close()

    def close(self) -> None:
        with self._lock:
            self._drop_handle()
            if self._tensorboard is not None:
                self._tensorboard.close()
            self._handle, self.path, self._tensorboard, self._tensorboard_dir = None, None, None, None
