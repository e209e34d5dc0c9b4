"""Writing a file all at once, the one way every world of ddpack does it (the launcher, the trainer, the host): through
a temporary name that mkstemp makes beside the target (random, created by this process: never a link or a file
another user planted in a shared or run folder), then renamed over it (the same folder: atomic). Standard library
only: the launcher, which everything else imports, holds it. The job's own program (enroot/ddpack_node.py) is sent to
a node as one file and keeps its own.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, content: str | bytes, mode: int | None = None, *, exclusive: bool = False, durable: bool = False) -> bool:
    """Replace `path` with `content` at once: a reader never sees half a file, and a link at `path` is replaced, never
    followed. `mode`: the file's permissions, which it never exists without (None: what open() gives under the
    umask). `exclusive`: only where `path` does not exist yet (False where it did). `durable`: the data on disk before
    the rename (fsync). True once written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~umask() if mode is None else mode)
            handle.write(content.encode() if isinstance(content, str) else content)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return True


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread at once)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Umask:")).split()[1], 8)
    return 0o077  # unknown: the private choice
