"""From image to first training step under pyxis: the bundle's squashfs against `enroot import`'s.

Two squashfs files of the bundle's image: `enroot import dockerd://` with HyperPod's
ENROOT_SQUASH_OPTIONS (what users do today) and `make sqsh` with ddpack's default options; optionally a
third, `enroot import` of an older image (--baseline-image, e.g. one built before bytecode and trimming).
For each, rounds alternate the order (A B, B A, ...) and the medians are printed:

- srun -> first progress line: `srun -N2 --ntasks-per-node=1 --container-image=F entrypoint --epochs 1
  --log-every 1` until the first `step 1/` line (pyxis unpacks the image on both nodes, then 2 gloo ranks);
- the pieces, with enroot alone on one node: unpack (`enroot create`), container start (`enroot start
  NAME true`), imports in a fresh container (`python -c 'import torch, torch.distributed'`), and the
  unpack's floor: a bare `unsquashfs` of the same file right after, in the same memory and disk state.

The filesystem that holds enroot's data folders decides the unpack: on ext4 without a journal (this
VM's root) the kernel will not reuse an inode freed in the last 60 s (6 min while its inode-table block is
dirty), and it finds a free one by looking at every recently freed one, so an unpack that follows a removal (every job's) costs ~10x what it
does on a journaled ext4 or xfs. The first line names the filesystem; `--journaled-data DIR` mounts a fresh
journaled ext4 (a loop file, plain `mkfs.ext4`, as on a node's disk) over DIR, the folder every node's
ENROOT_DATA_PATH lies under (here /tmp/enroot/data), for the run.

Needs root, enroot and a Slurm with pyxis (testbed/slurm_cluster.py starts one here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_sqsh import timed  # noqa: E402

from ddpack.images.enroot_tree import HYPERPOD_SQUASH_OPTIONS  # noqa: E402
from ddpack.images.sqsh import DEFAULT_SQUASH_OPTIONS, convert  # noqa: E402
from testbed.slurm_cluster import mount_journaled_ext4  # noqa: E402

IMPORTS = "import torch, torch.distributed"


def timed_run(argv: list[str], env: dict[str, str]) -> float:
    return timed(lambda: subprocess.run(argv, check=True, capture_output=True, env=env))


def pieces(sqsh: Path, data: Path) -> dict[str, float]:
    env = {**os.environ, "ENROOT_DATA_PATH": str(data)}
    name = "ddpack-bench-start"
    subprocess.run(["enroot", "remove", "-f", name], env=env, capture_output=True)
    out = {"unpack": timed_run(["enroot", "create", "--name", name, str(sqsh)], env=env)}
    out["imports (fresh)"] = timed_run(["enroot", "start", name, "python", "-c", IMPORTS], env=env)
    out["container start"] = timed_run(["enroot", "start", name, "true"], env=env)
    out["imports (again)"] = timed_run(["enroot", "start", name, "python", "-c", IMPORTS], env=env)
    subprocess.run(["enroot", "remove", "-f", name], env=env, capture_output=True)
    # The unpack's floor in the same state: a bare unsquashfs (no -user-xattrs, no fixperms pass).
    bare = data / "bare-unsquashfs"
    out["unpack floor"] = timed_run(["unsquashfs", "-no-progress", "-d", str(bare), str(sqsh)], env=env)
    subprocess.run(["rm", "-rf", str(bare)], check=True)
    return out


def to_first_step(sqsh: Path, work: Path) -> float:
    snapshots = tempfile.mkdtemp(prefix="snapshots-", dir=work)  # a fresh run each time, never a resume
    argv = ["srun", "-N2", "--ntasks-per-node=1", f"--container-image={sqsh}", f"--container-workdir={work}"]
    argv += [f"--container-mounts={work}:{work}", "entrypoint", "--epochs", "1", "--log-every", "1", "--snapshot-dir", snapshots]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=work)
    first = None
    for line in proc.stdout:
        if first is None and " step 1/" in line:
            first = time.monotonic() - started
    if proc.wait() != 0 or first is None:
        raise SystemExit(f"bench_start: srun failed (exit {proc.returncode}) for {sqsh}")
    return first


def inodes(sqsh: Path) -> int:
    out = subprocess.run(["unsquashfs", "-s", str(sqsh)], capture_output=True, text=True, check=True).stdout
    return int(next(line.split()[-1] for line in out.splitlines() if line.startswith("Number of inodes")))


def filesystem(path: Path) -> str:
    """The filesystem holding `path`, saying whether an ext4 has a journal (jbd2 runs one per journal)."""
    source, fstype = subprocess.run(
        ["findmnt", "-no", "SOURCE,FSTYPE", "-T", str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    if fstype == "ext4":
        journal = Path("/sys/fs/ext4", Path(source).name, "journal_task")
        if journal.exists() and journal.read_text().strip() == "<none>":
            return f"{source} ext4 without a journal"
    return f"{source} {fstype}"


@contextlib.contextmanager
def journaled_ext4(folder: Path, size_gib: int = 16) -> Iterator[None]:
    """A fresh journaled ext4 over `folder` for the run, with its folders (no containers) as they were."""
    if os.geteuid() != 0 or not folder.is_dir():
        raise SystemExit(
            f"bench_start: --journaled-data needs root and an existing folder (the one enroot's data folders lie under); got {folder}"
        )
    held = [p for user in folder.glob("**/user-*") for p in user.iterdir()]
    if held:
        raise SystemExit(f"bench_start: {held[0]} exists; remove the containers under {folder} (enroot remove) first")
    fd, name = tempfile.mkstemp(prefix="ddpack-bench-start-", suffix=".ext4", dir="/var/tmp")
    os.close(fd)
    image = Path(name)
    try:
        mount_journaled_ext4(folder, image, size_gib)
        try:
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)
    finally:
        image.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--baseline-image", help="also time `enroot import` of this (older) image")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--journaled-data", type=Path, metavar="DIR", help="mount a fresh journaled ext4 over DIR for the run")
    opts = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpack-bench-start-", dir="/tmp")))
        folder.chmod(0o1777)
        data = folder / "data"
        if opts.journaled_data:
            stack.enter_context(journaled_ext4(opts.journaled_data))
            data = opts.journaled_data / "ddpack-bench-pieces"
        print(f"start    enroot data on {filesystem(data.parent)}", flush=True)
        os.environ["ENROOT_SQUASH_OPTIONS"] = HYPERPOD_SQUASH_OPTIONS  # every file, enroot's imports included
        files = {"enroot import (HyperPod options)": convert(opts.image, folder / "enroot.sqsh", "enroot", force=True)}
        files[f"make sqsh ({DEFAULT_SQUASH_OPTIONS})"] = convert(opts.image, folder / "ddpack.sqsh", force=True)
        if opts.baseline_image:
            files[f"enroot import of {opts.baseline_image}"] = convert(opts.baseline_image, folder / "baseline.sqsh", "enroot", force=True)
        results: dict[str, dict[str, list[float]]] = {label: {} for label in files}
        labels = list(files)
        for round_ in range(opts.rounds):
            for label in labels if round_ % 2 == 0 else labels[::-1]:
                row = results[label]
                row.setdefault("srun -> first step", []).append(to_first_step(files[label], folder))
                for piece, seconds in pieces(files[label], data).items():
                    row.setdefault(piece, []).append(seconds)
                print(f"start round {round_ + 1}: {label}: {row['srun -> first step'][-1]:.1f}s", flush=True)
        columns = list(next(iter(results.values())))
        print(f"\nstart    {'squashfs':<40} {'MiB':>6} {'inodes':>7} " + " ".join(f"{c:>19}" for c in columns))
        reference = labels[-1] if opts.baseline_image else labels[0]
        base = statistics.median(results[reference]["srun -> first step"])
        for label in labels:
            size = files[label].stat().st_size / 2**20
            medians = [statistics.median(results[label][c]) for c in columns]
            print(f"start    {label:<40} {size:6.0f} {inodes(files[label]):7,} " + " ".join(f"{m:18.2f}s" for m in medians))
        for label in labels:
            if label != reference:
                ratio = statistics.median(results[label]["srun -> first step"]) / base
                print(f"start    {label}: srun -> first step {ratio:.2f}x that of {reference} (target <= 0.6x)")


if __name__ == "__main__":
    main()
