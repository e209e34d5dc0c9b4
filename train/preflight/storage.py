"""Storage: rank 0 writes, fsyncs and reads back a test file in the snapshot folder.

Snapshots are written by rank 0 alone (and read by it on resume), so this is the folder and the
process that matter. A folder that cannot be created or written is the check's failure, named in one
line; a read-back that differs is too. The test file is removed on every path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

TEST_BYTES = 64 << 20
CHUNK = 4 << 20


@dataclass(frozen=True, kw_only=True)
class StorageResult:
    folder: str
    error: str | None = None
    nbytes: int = 0
    write_mbps: float = 0.0
    read_mbps: float = 0.0
    free_bytes: int = 0


def check_storage(folder: str, seconds: float, nbytes: int = TEST_BYTES) -> StorageResult:
    """Write up to `nbytes` (fewer if the time share runs out), fsync, drop the cache, read back."""
    path = Path(folder) / f".ddpack-preflight-{os.getpid()}"
    block = os.urandom(CHUNK)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + seconds / 2
        started = time.perf_counter()
        written = hashlib.sha256()
        with open(path, "wb") as handle:
            total = 0
            while total < nbytes and (total == 0 or time.monotonic() < deadline):
                handle.write(block)
                written.update(block)
                total += len(block)
            handle.flush()
            os.fsync(handle.fileno())
        write_s = time.perf_counter() - started
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
            started = time.perf_counter()
            read = hashlib.sha256()
            while chunk := os.read(fd, CHUNK):
                read.update(chunk)
            read_s = time.perf_counter() - started
        finally:
            os.close(fd)
        if read.digest() != written.digest():
            return StorageResult(folder=folder, error=f"storage: {folder}: the test file read back differs from what was written")
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return StorageResult(
            folder=folder,
            error=f"storage: cannot write to the snapshot folder {folder} ({reason}: {exc.filename or folder}); "
            "make it writable by this job's user or pass --snapshot-dir a folder that is",
        )
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return StorageResult(folder=folder, nbytes=total, write_mbps=total / write_s / 1e6, read_mbps=total / read_s / 1e6, free_bytes=free)
