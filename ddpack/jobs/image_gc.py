"""`ddpack gc --images [DIR] [--dry-run]`: the squashfs files of yours in the shared images folder that no run of yours
names any more, removed (with their `.ddpack.json` record beside them).

Only a plain file of this user's alone is a candidate (another user's, a link, one others may write: never touched),
and a file any run or sweep point under the runs folder names (run.json's `sqsh.path`) is kept: a run you may still
`resubmit` keeps its image. A run folder elsewhere (another --runs) is not seen: gc with that --runs too, or keep it.
A runs folder that is missing or holds no run of yours is refused (it would keep nothing), and an image a live job
of yours names (its run folder's record, or its job script) is kept wherever its run folder is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ddpack.errors import HostError
from ddpack.images.sqsh import RECORD_SUFFIX
from ddpack.private_files import not_yours_alone
from train.run_folder import RUN_RECORD


@dataclass(frozen=True)
class Unused:
    path: Path
    size: int


def named_images(runs: Path) -> set[str]:
    """Every squashfs a run of yours under `runs` names (a sweep's points too)."""
    from ddpack.jobs.find_runs import list_runs

    return {os.path.realpath(record.sqsh["path"]) for _, record in list_runs(runs) if record.sqsh.get("path")}


def runs_to_keep(runs: Path) -> None:
    """The runs folder whose runs' images are kept must be one that holds runs: a misspelled or empty one names no
    image, and every image of yours would go (one line, exit 2)."""
    from ddpack.jobs.find_runs import list_runs

    if not runs.is_dir():
        raise HostError(f"--runs {runs} is not a folder: gc keeps the images your runs there name, so it would remove every image "
                        "of yours; give the runs folder (--runs DIR, or DDPACK_RUNS)", code=2)  # fmt: skip
    if not list_runs(runs):
        raise HostError(f"--runs {runs} holds no run of yours: gc keeps the images your runs there name, so it would remove every "
                        "image of yours; give the runs folder your runs are in (--runs DIR, or DDPACK_RUNS)", code=2)  # fmt: skip


def live_images() -> tuple[set[str], str]:
    """The squashfs files your live jobs (waiting or running: squeue's own list) name, from the run folder each works
    in (run.json's sqsh.path, a sweep's points' too) and its job script (a template's by hand: its text), as the
    texts to look for each image's path in; one line, exit 1, when squeue cannot say which jobs live."""
    import getpass

    from ddpack.jobs import slurm_cli
    from ddpack.jobs.run_json import read_record
    from ddpack.jobs.sweep_points import is_sweep, point_dirs

    user = os.environ.get("USER") or getpass.getuser()
    answer = slurm_cli.ask(["squeue", "-h", "-u", user, "-o", "%i|%Z|%o"])
    if answer.failed:
        raise HostError(
            f"cannot tell which of your jobs live, whose images gc must keep: {answer.failed}; nothing removed, try again", code=1
        )
    named: set[str] = set()
    texts = []
    for line in answer.stdout.splitlines():
        _, _, rest = line.partition("|")
        workdir, _, script = rest.partition("|")
        folder = Path(workdir.strip())
        try:
            for run_dir in (point_dirs(folder) if is_sweep(folder) else [folder]) if folder.is_absolute() else []:
                if (run_dir / RUN_RECORD).is_file() and (sqsh := read_record(run_dir).sqsh.get("path")):
                    named.add(os.path.realpath(sqsh))
        except HostError:  # not a run or sweep folder of yours: its script may still name the image
            pass
        try:
            if (path := Path(script.strip())).is_absolute() and path.stat().st_size < 2**20:
                texts.append(path.read_text(errors="replace"))
        except OSError:
            continue
    return named, "\n".join(texts)


def unused_images(images: Path, runs: Path) -> list[Unused]:
    """The squashfs files of yours alone in `images` that no run under `runs` and no live job of yours names, largest
    first."""
    if not images.is_dir():
        raise HostError(f"--images {images} is not a folder (the shared images folder: --images DIR, or DDPACK_IMAGES)", code=2)
    runs_to_keep(runs)
    live, scripts = live_images()
    named = (
        named_images(runs)
        | live
        | {os.path.realpath(path) for path in images.glob("*.sqsh") if str(path) in scripts or os.path.realpath(path) in scripts}
    )
    found = [Unused(path, path.stat().st_size) for path in sorted(images.glob("*.sqsh"))
             if not_yours_alone(path) is None and os.path.realpath(path) not in named]  # fmt: skip
    return sorted(found, key=lambda item: -item.size)


def remove_images(unused: list[Unused]) -> None:
    for item in unused:
        record = item.path.with_name(item.path.name + RECORD_SUFFIX)
        item.path.unlink(missing_ok=True)
        if not_yours_alone(record) is None:
            record.unlink(missing_ok=True)
