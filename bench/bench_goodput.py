"""Goodput at scale: a job's start (sbatch -> first training step) and its recovery (failure -> training again)
through enroot/pyxis-per-task.sbatch on the test cluster, today's path side by side with ddpack's, then the model
(ddpack/goodput_model.py) at 2 to 1,024 nodes fed with the per-node figures measured here.

Start, interleaved rounds (A B C, A B C, ...), medians:
- shared (today): DDPACK_STAGE=off: every node reads the squashfs from the shared folder and unpacks it;
- staged, cold: DDPACK_STAGE=sbcast with no copy on the nodes: one read, sent by sbcast to every node's disk;
- staged, warm: the same image again: the nodes hold it, nothing is read or sent.
Recovery, one job each, rank 3 SIGKILLed once training runs (the survivors' collective fails):
- requeue (today): DDPACK_RESTART_IN_PLACE=0: the template requeues the job; Slurm starts it again (here once the
  old credential expires, cred_expire=10 s) and pyxis unpacks the image again on every node;
- in place: the template restarts the step in the allocation, in the container the first step unpacked.
  detect: the kill -> rank 0's end record; back: the kill -> the next start's first progress record.

This machine is one host: its "shared folder" is local disk, so staging costs here what it saves on a cluster
(one more copy), and the two nodes' unpacks share two cores. The unpack runs on ext4 without a journal (this VM's
root), ~10x slower right after a removal (bench_start.py says why). The model takes the per-node rates from here
and the shared filesystem's throughput as assumed (ddpack/goodput_model.py). Needs root, the test cluster with pyxis
(testbed/slurm_cluster.py) and a squashfs (make sqsh; `make bench-goodput` makes one).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from ddpack.goodput_model import Site, table  # noqa: E402
from testbed.slurm_cluster import NODE_DISKS, NODES  # noqa: E402
from testbed.slurm_jobs import signal_tasks, submit, wait_for_end, wait_for_progress  # noqa: E402

TRAIN = "--dataset-size 16384 --epochs 3 --log-every 1 --snapshot-every 20"


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []


def first_progress(metrics: Path, after: float = 0.0) -> float | None:
    return next((r["time"] for r in records(metrics) if r["kind"] == "progress" and r["time"] > after), None)


def clear_staged() -> None:
    for node in NODES:  # the files only: each folder is mounted as its node's local disk
        for old in (NODE_DISKS / node).iterdir():
            old.unlink()


def start(folder: Path, sqsh: Path, shared: Path, stage: str, name: str) -> dict[str, float]:
    """sbatch -> the first progress record, then the job is cancelled (it has shown what it came for)."""
    folder.mkdir(parents=True, exist_ok=True)
    submitted = time.time()
    job, metrics, log = submit(
        folder, name, ("--ntasks-per-node=2",), "pyxis-per-task.sbatch",
        DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_STAGE=stage, DDPACK_TRAIN_ARGS=TRAIN,
    )  # fmt: skip
    try:
        wait_for_progress(metrics, 1, log, f"the {name} job did not train", timeout=900)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        wait_for_end(job, log)
    text = log.read_text()
    sent = re.search(r"ddpack: image: sent .* \((\d+) MiB\) once, by sbcast, .* in ([\d.]+) s", text)
    out = {"start_s": first_progress(metrics) - submitted}
    if sent:
        out["sbcast_s"], out["sbcast_mbps"] = float(sent.group(2)), int(sent.group(1)) * 1.048576 / max(float(sent.group(2)), 1e-3)
    return out


def recovery(folder: Path, sqsh: Path, shared: Path, in_place: bool, name: str) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    job, metrics, log = submit(
        folder, name, ("--ntasks-per-node=2",), "pyxis-per-task.sbatch",
        DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_RESTART_IN_PLACE="1" if in_place else "0", DDPACK_TRAIN_ARGS=TRAIN,
    )  # fmt: skip
    try:
        wait_for_progress(metrics, 30, log, f"the {name} job did not train", timeout=900)
        killed = time.time()
        if not signal_tasks(job, "ddnode2", signal.SIGKILL, rank=3):
            sys.exit("bench_goodput: no rank 3 on ddnode2")
        deadline = time.monotonic() + 900
        while (back := first_progress(metrics, after=killed + 0.001)) is None:
            if time.monotonic() > deadline:
                sys.exit(f"bench_goodput: the {name} job did not train again; see {log}")
            time.sleep(0.2)
        ends = [r for r in records(metrics) if r["kind"] == "end" and r["time"] >= killed]
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        wait_for_end(job, log)
    return {"detect_s": (ends[0]["time"] - killed) if ends else float("nan"), "back_s": back - killed}


def unpack_mbps(sqsh: Path) -> float:
    """One node's `enroot create` of the squashfs from local disk (right after a removal, as every job's is)."""
    name = "ddpack-bench-goodput"
    subprocess.run(["enroot", "remove", "-f", name], capture_output=True)
    began = time.monotonic()
    subprocess.run(["enroot", "create", "--name", name, str(sqsh)], check=True, capture_output=True)
    seconds = time.monotonic() - began
    subprocess.run(["enroot", "remove", "-f", name], capture_output=True)
    return sqsh.stat().st_size / 1e6 / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqsh", type=Path, required=True, help="the squashfs to start (make sqsh's output)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fsx-mbps", type=float, default=1200.0, help="the model's shared-filesystem throughput, all nodes together")
    opts = parser.parse_args()
    if shutil.which("sinfo") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print("bench_goodput: no Slurm controller answers (sinfo); start the test cluster: .venv/bin/python testbed/slurm_cluster.py", file=sys.stderr)
        return 2
    if not opts.sqsh.is_file():
        print(f"bench_goodput: --sqsh {opts.sqsh} is not a file; make sqsh writes one", file=sys.stderr)
        return 2
    shared = Path(tempfile.mkdtemp(prefix="ddpack-bench-goodput-", dir="/tmp"))
    shared.chmod(0o1777)
    sqsh = shared / "image.sqsh"
    shutil.copyfile(opts.sqsh, sqsh)
    size_mb = sqsh.stat().st_size / 1e6
    print(f"goodput: {opts.sqsh} ({size_mb:,.0f} MB), pyxis-per-task.sbatch, 4 ranks on 2 nodes, trainer {TRAIN}", flush=True)
    try:
        starts: dict[str, list[dict[str, float]]] = {"shared (today)": [], "staged, cold": [], "staged, warm": []}
        for round_ in range(opts.rounds):
            for label, stage in (("shared (today)", "off"), ("staged, cold", "sbcast"), ("staged, warm", "sbcast")):
                if label == "staged, cold":
                    clear_staged()
                starts[label].append(start(shared / f"s{round_}-{stage}", sqsh, shared, stage, f"start-{round_}"))
                print(f"goodput: start round {round_ + 1}, {label}: {starts[label][-1]}", flush=True)
        backs = {"requeue (today)": recovery(shared / "rq", sqsh, shared, False, "requeue"), "in place": recovery(shared / "ip", sqsh, shared, True, "inplace")}
        for label, figures in backs.items():
            print(f"goodput: recovery, {label}: {figures}", flush=True)
        unpack = statistics.median(unpack_mbps(sqsh) for _ in range(2))
    finally:
        clear_staged()
        shutil.rmtree(shared, ignore_errors=True)

    print(f"\nstart: sbatch -> first training step ({opts.rounds} interleaved rounds, medians)")
    shared_s = statistics.median(r["start_s"] for r in starts["shared (today)"])
    for label, rows in starts.items():
        median = statistics.median(r["start_s"] for r in rows)
        extra = f"  (sbcast {statistics.median(r['sbcast_s'] for r in rows):.1f} s)" if all("sbcast_s" in r for r in rows) else ""
        print(f"  {label:<16} {median:>7.1f} s   {median / shared_s:.2f}x today{extra}")
    print("recovery: rank 3 SIGKILLed -> training again")
    for label, figures in backs.items():
        print(f"  {label:<16} detect {figures['detect_s']:>5.1f} s   back {figures['back_s']:>6.1f} s")
    ratio = backs["in place"]["back_s"] / backs["requeue (today)"]["back_s"]
    print(f"  in place / requeue: {ratio:.2f}x; its floor is the trainer's start (imports, rendezvous, the snapshot, the first step)")
    sbcast = [r["sbcast_mbps"] for r in starts["staged, cold"] if "sbcast_mbps" in r]
    in_place = backs["in place"]
    site = Site(
        fsx_mbps=opts.fsx_mbps,
        sbcast_mbps=statistics.median(sbcast) if sbcast else Site().sbcast_mbps,
        unpack_mbps=unpack,
        detect_s=in_place["detect_s"],
        trainer_s=max(1.0, in_place["back_s"] - in_place["detect_s"] - Site().step_s),
        requeue_s=max(0.0, backs["requeue (today)"]["back_s"] - in_place["back_s"] - size_mb / unpack),
    )
    print(f"\nmodel (ddpack/goodput_model.py), per-node figures measured here: {site}")
    print(table(site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
