"""`ddpack gc --images [DIR] [--dry-run]`: the squashfs files of yours in the shared images folder that no run of yours
names any more, removed (with their `.ddpack.json` record beside them).

Only a plain file of this user's alone is a candidate (another user's, a link, one others may write: never touched),
and a file any run or sweep point under the runs folder names (run.json's `sqsh.path`) is kept: a run you may still
`resubmit` keeps its image. A run folder elsewhere (another --runs) is not seen: gc with that --runs too, or keep it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ddpack.errors import HostError
from ddpack.images.sqsh import RECORD_SUFFIX
from ddpack.private_files import not_yours_alone


@dataclass(frozen=True)
class Unused:
    path: Path
    size: int


def named_images(runs: Path) -> set[str]:
    """Every squashfs a run of yours under `runs` names (a sweep's points too)."""
    from ddpack.jobs.find_runs import list_runs

    return {os.path.realpath(record.sqsh["path"]) for _, record in list_runs(runs) if record.sqsh.get("path")}


def unused_images(images: Path, runs: Path) -> list[Unused]:
    """The squashfs files of yours alone in `images` that no run under `runs` names, largest first."""
    if not images.is_dir():
        raise HostError(f"--images {images} is not a folder (the shared images folder: --images DIR, or DDPACK_IMAGES)", code=2)
    named = named_images(runs)
    found = [Unused(path, path.stat().st_size) for path in sorted(images.glob("*.sqsh"))
             if not_yours_alone(path) is None and os.path.realpath(path) not in named]  # fmt: skip
    return sorted(found, key=lambda item: -item.size)


def remove_images(unused: list[Unused]) -> None:
    for item in unused:
        record = item.path.with_name(item.path.name + RECORD_SUFFIX)
        item.path.unlink(missing_ok=True)
        if not_yours_alone(record) is None:
            record.unlink(missing_ok=True)
