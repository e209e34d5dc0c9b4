"""Files a host verb writes where other users may write too (a shared output folder such as /fsx/images, a
home folder): through a temporary name mkstemp makes beside the target (random, created by this process, so
never a link or a file another user planted), then renamed over it (the same folder: atomic); and a check of
what was not just made before it is trusted. Standard library only.
"""

from __future__ import annotations

from pathlib import Path

from entrypoint import atomic_file


def write_atomically(path: Path, content: str | bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace `path` with `content` all at once (entrypoint/atomic_file.py, on disk before the rename unless not
    `durable`: a cache that a crash may lose, made again when it is); a folder that is not there yet is made this
    user's alone (0700)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_file.write_atomically(path, content, mode, durable=durable)


def not_yours_alone(path: Path, want: str = "file") -> str | None:
    """Why `path` is not this user's alone (a plain file with one name, or a folder with `want="folder"`; not a link,
    this user's, nobody else can write it), or None when it is: what anything read back from a shared folder passes
    first. The job's own check (enroot/ddpack_node.py), so that host and job hold one rule."""
    from ddpack.job_side import node_helper

    return node_helper().not_yours_alone(path, want)
