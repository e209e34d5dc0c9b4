"""Atomic snapshots in one directory: write to a temp file, fsync, rename, fsync the directory.

Only global rank 0 calls these. A reader never sees a half-written file under a snapshot name, and a
crash mid-write leaves only a hidden temp file. Loading walks from the newest to the oldest snapshot
and skips (reporting, never deleting) any that cannot be read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.distributed import first_line

SNAPSHOT_RE = re.compile(r"^snapshot-(\d{10})\.pt$")
# A snapshot from before the learning rate became a function of the step also holds "scheduler",
# which is not read: the step decides the rate.
REQUIRED_KEYS = ("format", "model", "optimizer", "epoch", "step_in_epoch", "global_step", "rng", "world_size", "config")
FORMAT = 1


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


@dataclass
class SnapshotStore:
    """Rank 0's view of the snapshot directory across one run."""

    directory: Path
    keep: int = 2
    unreadable: set[Path] = field(default_factory=set)

    def load_latest(self) -> tuple[dict[str, Any] | None, Path | None, list[str]]:
        """(state, path, reports): the newest snapshot that loads and has every key; reports say why
        newer ones were skipped."""
        reports: list[str] = []
        for path in list_snapshots(self.directory):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
                missing = [k for k in REQUIRED_KEYS if k not in state]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
                if state["format"] != FORMAT:
                    raise ValueError(f"format {state['format']} is not {FORMAT}")
            except Exception as exc:  # any failure to read means: do not trust it
                reason = first_line(exc)
                reports.append(f"snapshot {path} is unreadable ({reason}); skipping it (left in place)")
                self.unreadable.add(path)
                continue
            return state, path, reports
        return None, None, reports

    def save(self, state: dict[str, Any]) -> Path:
        """Write atomically, then drop readable snapshots beyond the newest `keep`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / snapshot_name(state["global_step"])
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as handle:
                torch.save({"format": FORMAT, **state}, handle)
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
