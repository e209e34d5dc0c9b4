"""Atomic snapshots in one directory: write to a temp file, fsync, rename, fsync the directory.

Only global rank 0 calls these. A reader never sees a half-written file under a snapshot name, and a
crash mid-write leaves only a hidden temp file (removed by the next run's load). Loading walks from the
newest to the oldest snapshot and skips (reporting, never deleting) any that cannot be read.

`SnapshotWriter` takes the write off the training's critical path: training is held only while the
state is copied to host memory; serialising, writing, fsync and rename run on a thread of their own.
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from train.distributed import first_line

SNAPSHOT_RE = re.compile(r"^snapshot-(\d{10})\.pt$")
TEMP_RE = re.compile(r"^\.snapshot-\d{10}\.pt\.tmp-\d+$")
FORMAT = 1


@dataclass(kw_only=True)
class Snapshot:
    """The trainer's saved state: written and read back as this one type (as minGPT-ddp's `Snapshot`), so that
    new state is one field here. On disk it is a plain dict of these fields plus "format" (torch.load with
    weights_only=True reads only plain containers and tensors)."""

    model: dict[str, Any]  # the module's state dict (never the compiled or DDP-wrapped one's)
    optimizer: dict[str, Any]
    epoch: int  # from 0
    step_in_epoch: int  # optimizer steps done in `epoch`
    global_step: int
    rng: list[dict[str, Any]]  # every rank's RNG states, by rank
    world_size: int
    config: dict[str, Any]  # Config.to_dict() of the run that wrote it

    def as_dict(self) -> dict[str, Any]:
        """The fields as they are (no copy: asdict would deep-copy every tensor)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        """A loaded file's dict; ValueError naming what is missing or which format it is. Keys of older
        formats are ignored (a snapshot from before the learning rate became a function of the step also
        holds "scheduler", which is not read: the step decides the rate)."""
        names = [f.name for f in fields(cls)]
        missing = [k for k in ("format", *names) if k not in data]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']} is not {FORMAT}")
        return cls(**{k: data[k] for k in names})


def snapshot_name(global_step: int) -> str:
    return f"snapshot-{global_step:010d}.pt"


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshot files, newest (highest step) first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if SNAPSHOT_RE.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotsUnreadable(Exception):
    """Snapshots that should be there cannot be read: every file in the folder is unreadable, or the metrics file
    records one that the folder no longer holds (a filesystem not mounted for a moment). Training from step 0 would
    then rotate the good ones away once they are back; the run stops with one line instead (exit 2: a person looks)."""


def recorded_snapshot(metrics: Path, directory: Path) -> tuple[int, str] | None:
    """(step, path) of the newest snapshot that the metrics file records as written in `directory`; None where it
    records none (or cannot be read: a torn line is skipped, a missing file is a new run)."""
    try:
        lines = metrics.read_text(errors="replace").splitlines()
    except OSError:
        return None
    where, found = str(directory.absolute()), None
    for line in lines:
        if '"snapshot"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        path = record.get("path") if isinstance(record, dict) and record.get("kind") == "snapshot" else None
        step = record.get("global_step") if isinstance(path, str) and str(Path(path).absolute().parent) == where else None
        if isinstance(step, int) and (found is None or step >= found[0]):
            found = (step, str(path))
    return found


@dataclass
class SnapshotStore:
    """Rank 0's view of the snapshot directory across one run."""

    directory: Path
    keep: int = 2
    unreadable: set[Path] = field(default_factory=set)

    def load_latest(self, metrics: Path | None = None) -> tuple[Snapshot | None, Path | None, list[str]]:
        """(snapshot, path, reports): the newest snapshot that loads and has every field; reports say why
        newer ones were skipped. SnapshotsUnreadable where there are snapshots and none loads, or where none is
        there and `metrics` (the run's metrics file) records one written here."""
        reports: list[str] = []
        for temp in self.directory.glob(".snapshot-*") if self.directory.is_dir() else []:
            if TEMP_RE.match(temp.name):  # one rank writes: a temp file at start is a dead writer's
                temp.unlink(missing_ok=True)
                reports.append(f"removed {temp.name}, a snapshot write that a crash interrupted")
        for path in list_snapshots(self.directory):
            try:
                snapshot = Snapshot.from_dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as exc:  # any failure to read means: do not trust it
                reason = first_line(exc)
                reports.append(f"snapshot {path} is unreadable ({reason}); skipping it (left in place)")
                self.unreadable.add(path)
                continue
            return snapshot, path, reports
        if self.unreadable:
            newest = reports[-len(self.unreadable)].removeprefix("snapshot ").removesuffix("; skipping it (left in place)")
            raise SnapshotsUnreadable(
                f"none of the {len(self.unreadable)} snapshots in {self.directory} can be read (the newest: {newest}); training from "
                "step 0 would rotate them away: fix or move them aside (to start over), then resume"
            )
        recorded = recorded_snapshot(metrics, self.directory) if metrics is not None else None
        if recorded is not None:
            raise SnapshotsUnreadable(
                f"{metrics} records the snapshot of step {recorded[0]} ({recorded[1]}), but {self.directory} holds none "
                "(a filesystem not mounted here, or the files moved?); make it visible and resume, or start a new run in a new run folder"
            )
        return None, None, reports

    def save(self, snapshot: Snapshot) -> Path:
        """Write atomically, then drop readable snapshots beyond the newest `keep`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / snapshot_name(snapshot.global_step)
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as handle:
                torch.save({"format": FORMAT, **snapshot.as_dict()}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            if final in self.unreadable and final.exists():
                # A corrupt file holds this name: move it aside rather than destroy the evidence.
                final.rename(final.with_name(final.name + ".unreadable"))
                self.unreadable.discard(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        finally:
            tmp.unlink(missing_ok=True)
        self._rotate()
        return final

    def _rotate(self) -> None:
        readable = [p for p in list_snapshots(self.directory) if p not in self.unreadable]
        for old in readable[self.keep :]:
            old.unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True)
class Written:
    """One snapshot made durable: how long training was held for it and how long the write took."""

    path: Path
    global_step: int
    stall_s: float
    write_s: float


class SnapshotWriteError(RuntimeError):
    """A background write failed (a full disk, a vanished mount); the previous snapshot stands."""


class SnapshotWriter:
    """Rank 0's snapshots, written in the background, at most one in flight.

    `submit` copies every tensor of the state into host buffers kept from the last snapshot (so a
    copy is a memcpy, not a fresh allocation's page faults) and returns; a thread then serialises,
    writes, fsyncs and renames through the store. A submit while a write is in flight waits for it
    first (host memory holds one copy, and that wait is counted as stall). `wait` returns once the
    last snapshot is durable, and raises a failed write's error there: a stop, a preemption and the
    end of training call it before leaving. A crash mid-write leaves the previous snapshot intact
    (the store renames only complete files)."""

    def __init__(self, store: SnapshotStore, on_written: Callable[[Written], None]) -> None:
        self.store, self.on_written = store, on_written
        self.last: Written | None = None
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, snapshot: Snapshot, held_since: float) -> None:
        """Copy `snapshot` off and start writing it; `held_since` is when training stopped for it."""
        self.wait()
        host = Snapshot(**self._to_host(snapshot.as_dict(), ()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        stall_s = time.monotonic() - held_since
        self._thread = threading.Thread(target=self._write, args=(host, stall_s), name="ddpack-snapshot-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Written | None:
        """Block until no write is in flight; the last durable snapshot (None before the first)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _write(self, host: Snapshot, stall_s: float) -> None:
        started = time.monotonic()
        try:
            path = self.store.save(host)
        except BaseException as exc:  # handed to the training thread at its next wait
            where = f"the snapshot of step {host.global_step} could not be written to {self.store.directory}"
            self._error = SnapshotWriteError(
                f"{where}: {first_line(exc)}; make room or fix its permissions, or pass another --snapshot-dir, then resume"
            )
            return
        self.last = Written(path=path, global_step=host.global_step, stall_s=stall_s, write_s=time.monotonic() - started)
        try:
            self.on_written(self.last)
        except Exception as exc:  # its record could not be written (a full run folder): raised at the next wait too
            self._error = exc

    def _to_host(self, value: Any, key: tuple[Any, ...]) -> Any:
        """A copy whose tensors live in this writer's host buffers and whose containers are new, so
        training may change the original at once."""
        if isinstance(value, torch.Tensor):
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                pin = value.device.type == "cuda"
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
                self._buffers[key] = buffer
            buffer.copy_(value.detach(), non_blocking=value.device.type == "cuda")
            return buffer
        if isinstance(value, dict):
            return {k: self._to_host(v, (*key, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._to_host(v, (*key, i)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value if isinstance(value, (int, float, str, bool, type(None))) else copy.deepcopy(value)
