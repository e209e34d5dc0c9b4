"""What the shared-cluster checks cost a job's start: the job helper before them against the helper now, side by side.

Each round runs, as one Slurm job on two nodes, the part of a pyxis template that the checks changed: `ddpack_setup`
(now also the umask, the run folder's lock and the watchdog's secret) and `ddpack_prepare_nodes` (now ddpack_node.py
on every node: the staging folder's owner, mode, parents and filesystem, the lease, the cleanup by name), then
`ddpack_leave`. Both helpers find the image staged on both nodes already (the warm path, a job's usual start), and,
with --cold, stage it by sbcast first (the new helper into a fresh private folder). A B A B ..., medians; the
figure is the time inside the job from before ddpack_setup to after ddpack_prepare_nodes.

    python bench/bench_stage_checks.py [--before dc3ebc3] [--rounds 5] [--cold]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.env import ROOT
from testbed.slurm_cluster import clear_staged_images, ensure_cluster
from testbed.slurm_jobs import env

JOB = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output=logs/%x-%j.out
set -uo pipefail
. "${DDPACK_HOME}/ddpack-job.sh"
started=$(date +%s%N)
ddpack_setup stage
ddpack_name_container
ddpack_prepare_nodes "$1"
echo "bench: start_ms=$((($(date +%s%N) - started) / 1000000)) image=${ddpack_image}"
ddpack_leave
"""


def helper_at(revision: str, into: Path) -> Path:
    """enroot/'s job files (ddpack-job.sh and the job's Python, one file or several) as they were at `revision`, in a
    folder of their own."""
    into.mkdir(parents=True)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{revision}:enroot"], capture_output=True, text=True, check=True)
    for name in listed.stdout.split():
        if name == "ddpack-job.sh" or name.endswith(".py"):
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:enroot/{name}"], capture_output=True, check=True)
            (into / name).write_bytes(shown.stdout)
    return into


def one_start(work: Path, home: Path, image: Path, stage: str) -> tuple[float, str]:
    out = subprocess.run(
        ["sbatch", "--wait", "--parsable", "--job-name=stage", str(work / "job.sbatch"), str(image)],
        cwd=work, capture_output=True, text=True, timeout=600, env={**env(), "DDPACK_HOME": str(home), "DDPACK_STAGE": stage},
    )  # fmt: skip
    log = (work / "logs" / f"stage-{out.stdout.strip()}.out").read_text()
    found = re.search(r"bench: start_ms=(\d+) image=(\S+)", log)
    assert out.returncode == 0 and found, log
    return int(found.group(1)) / 1000, found.group(2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="dc3ebc3", help="the commit whose job helper had no checks")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mb", type=int, default=256, help="the image's size (a stand-in file; its content does not matter here)")
    parser.add_argument("--cold", action="store_true", help="also time a cold start (the image sent by sbcast first)")
    opts = parser.parse_args()
    ensure_cluster()
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-stage-", dir="/tmp") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        (work / "job.sbatch").write_text(JOB)
        image = work / "img.sqsh"
        with image.open("wb") as handle:
            handle.truncate(opts.size_mb * 2**20)
        helpers = {"before": helper_at(opts.before, work / "before"), "now": helper_at("HEAD", work / "now")}
        for path in [ROOT / "enroot" / "ddpack-job.sh", *(ROOT / "enroot").glob("*.py")]:  # the working tree's, as it is now
            shutil.copy2(path, helpers["now"] / path.name)
        cases = [("warm", "sbcast")] + ([("cold", "sbcast")] if opts.cold else [])
        for case, stage in cases:
            times: dict[str, list[float]] = {"before": [], "now": []}
            for _ in range(opts.rounds):
                for side in ("before", "now"):
                    if case == "cold":
                        clear_staged_images()
                    else:
                        one_start(work, helpers[side], image, stage)  # the copy on both nodes first (its own helper's layout)
                    seconds, used = one_start(work, helpers[side], image, stage)
                    assert used != str(image), f"{side}: the start read the shared file, not the staged copy"
                    times[side].append(seconds)
            before, now = statistics.median(times["before"]), statistics.median(times["now"])
            print(f"{case} start, 2 nodes, {opts.size_mb} MiB image ({opts.rounds} rounds, A B A B): before the checks ({opts.before}) "
                  f"{before:.2f} s, with them {now:.2f} s: +{now - before:.2f} s")  # fmt: skip
    os.sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
