"""Files a host verb writes where other users may write too (a shared output folder such as /fsx/images, a
home folder): through a temporary name mkstemp makes beside the target (random, created by this process, so
never a link or a file another user planted), then renamed over it (the same folder: atomic); and a check of
what was not just made before it is trusted. Standard library only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, content: str | bytes, mode: int = 0o600) -> None:
    """Replace `path` with `content` all at once (a reader never sees half a file); the file never
    exists with other permissions, and a link at `path` is replaced, never followed."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def not_yours_alone(path: Path, want: str = "file") -> str | None:
    """Why `path` is not this user's alone (a plain file with one name, or a folder with `want="folder"`; not a link,
    this user's, nobody else can write it), or None when it is: what anything read back from a shared folder passes
    first. The job's own check (enroot/ddpack_node.py), so that host and job hold one rule."""
    from ddpack.job_side import node_helper

    return node_helper().not_yours_alone(path, want)
