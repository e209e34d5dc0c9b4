"""From image to first training step under pyxis: the bundle's squashfs against `enroot import`'s.

Two squashfs files of the bundle's image: `enroot import dockerd://` with HyperPod's
ENROOT_SQUASH_OPTIONS (what users do today) and `make sqsh` with ddpack's default options; optionally a
third, `enroot import` of an older image (--baseline-image, e.g. one built before bytecode and trimming).
For each, rounds alternate the order (A B, B A, ...) and the medians are printed:

- srun -> first progress line: `srun -N2 --ntasks-per-node=1 --container-image=F entrypoint --epochs 1
  --log-every 1` until the first `step 1/` line (pyxis unpacks the image on both nodes, then 2 gloo ranks);
- the pieces, with enroot alone on one node: unpack (`enroot create`), container start (`enroot start
  NAME true`), imports in a fresh container (`python -c 'import torch, torch.distributed'`).

Needs root, enroot and a Slurm with pyxis (tests/slurm_cluster.py starts one here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_sqsh import timed  # noqa: E402

from ddpack.enroot_tree import HYPERPOD_SQUASH_OPTIONS  # noqa: E402
from ddpack.sqsh import DEFAULT_SQUASH_OPTIONS, convert  # noqa: E402

IMPORTS = "import torch, torch.distributed"


def enroot_import(image: str, out: Path) -> Path:
    env = {**os.environ, "ENROOT_SQUASH_OPTIONS": HYPERPOD_SQUASH_OPTIONS}
    subprocess.run(["enroot", "import", "-o", str(out), f"dockerd://{image}"], env=env, check=True, capture_output=True)
    return out


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


def entries(sqsh: Path) -> int:
    out = subprocess.run(["unsquashfs", "-s", str(sqsh)], capture_output=True, text=True, check=True).stdout
    return int(next(line.split()[-1] for line in out.splitlines() if line.startswith("Number of inodes")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--baseline-image", help="also time `enroot import` of this (older) image")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-start-", dir="/tmp") as tmp:
        folder = Path(tmp)
        folder.chmod(0o1777)
        os.environ["ENROOT_SQUASH_OPTIONS"] = DEFAULT_SQUASH_OPTIONS
        files = {"enroot import (HyperPod options)": enroot_import(opts.image, folder / "enroot.sqsh")}
        files[f"make sqsh ({DEFAULT_SQUASH_OPTIONS})"] = convert(opts.image, folder / "ddpack.sqsh", force=True)
        if opts.baseline_image:
            files[f"enroot import of {opts.baseline_image}"] = enroot_import(opts.baseline_image, folder / "baseline.sqsh")
        results: dict[str, dict[str, list[float]]] = {label: {} for label in files}
        labels = list(files)
        for round_ in range(opts.rounds):
            for label in labels if round_ % 2 == 0 else labels[::-1]:
                row = results[label]
                row.setdefault("srun -> first step", []).append(to_first_step(files[label], folder))
                for piece, seconds in pieces(files[label], folder / "data").items():
                    row.setdefault(piece, []).append(seconds)
                print(f"start round {round_ + 1}: {label}: {row['srun -> first step'][-1]:.1f}s", flush=True)
        columns = list(next(iter(results.values())))
        print(f"\nstart    {'squashfs':<40} {'MiB':>6} {'inodes':>7} " + " ".join(f"{c:>19}" for c in columns))
        reference = labels[-1] if opts.baseline_image else labels[0]
        base = statistics.median(results[reference]["srun -> first step"])
        for label in labels:
            size = files[label].stat().st_size / 2**20
            medians = [statistics.median(results[label][c]) for c in columns]
            print(f"start    {label:<40} {size:6.0f} {entries(files[label]):7,} " + " ".join(f"{m:18.2f}s" for m in medians))
        for label in labels:
            if label != reference:
                ratio = statistics.median(results[label]["srun -> first step"]) / base
                print(f"start    {label}: srun -> first step {ratio:.2f}x that of {reference} (target <= 0.6x)")


if __name__ == "__main__":
    main()
