"""Goodput at scale: a job's start (sbatch -> first training step) and its recovery (failure -> training again)
through enroot/pyxis-per-task.sbatch on the test cluster, today's path side by side with ddpack's, then the model
(ddpack/jobs/goodput_model.py) at 2 to 1,024 nodes fed with the per-node figures measured here.

Start, interleaved rounds (A B C, A B C, ...), medians:
- shared (today): DDPACK_STAGE=off: every node reads the squashfs from the shared folder and unpacks it;
- staged, cold: DDPACK_STAGE=sbcast with no copy on the nodes: one read, sent by sbcast to every node's disk;
- staged, warm: the same image again: the nodes hold it, nothing is read or sent.
Recovery, one job each, rank 3 SIGKILLed once training runs (the survivors' collective fails):
- requeue (today): DDPACK_RESTART_IN_PLACE=0, DDPACK_STAGE=off: the template requeues the job; Slurm starts it
  again (here once the old credential expires, cred_expire=10 s) and pyxis unpacks the image again on every node;
- in place: the template restarts the step in the allocation, in the container the first step unpacked.
  Timed as bench_recovery.py times it (recovery_timing.py): detect, the kill -> the failing segment's end record;
  back, the kill -> the next start's first progress record; and back again from the job's log (the kill -> the
  restart's first progress line, polled), printed beside it as the check that the records timed the right thing.

This machine is one host: its "shared folder" is local disk, so staging costs here what it saves on a cluster
(one more copy), and the two nodes' unpacks share two cores. The unpack runs on ext4 without a journal (this VM's
root), ~10x slower right after a removal (bench_start.py says why). The model takes the per-node rates from here
and the shared filesystem's throughput as assumed (ddpack/jobs/goodput_model.py). Needs root, the test cluster with pyxis
(testbed/slurm_cluster.py) and a squashfs (make sqsh; `make bench-goodput` makes one).
"""

from __future__ import annotations

import argparse
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

from recovery_timing import ImplausibleRecovery, Recovery, follow, log_length, read_metrics  # noqa: E402

from ddpack.jobs.goodput_model import Site, table  # noqa: E402
from testbed.slurm_cluster import clear_staged_images  # noqa: E402
from testbed.slurm_jobs import job_state, signal_tasks, submit, wait_for_end, wait_for_progress  # noqa: E402

TRAIN = "--dataset-size 16384 --epochs 3 --log-every 1 --snapshot-every 20"


def first_progress(metrics: Path) -> float | None:
    return next((r["time"] for r in read_metrics(metrics) if r["kind"] == "progress"), None)


def start(folder: Path, sqsh: Path, shared: Path, stage: str, name: str) -> dict[str, float | str]:
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
    out: dict[str, float | str] = {"start_s": first_progress(metrics) - submitted}
    # The path the job took, in its own words: a "cold" start that did not stage is not a figure for staging.
    out["image"] = "; ".join(line.removeprefix("ddpack: image: ") for line in text.splitlines() if line.startswith("ddpack: image: "))
    if sent:
        out["sbcast_s"], out["sbcast_mbps"] = float(sent.group(2)), int(sent.group(1)) * 1.048576 / max(float(sent.group(2)), 1e-3)
    return out


def recovery(folder: Path, sqsh: Path, shared: Path, in_place: bool, name: str) -> Recovery:
    """Rank 3 SIGKILLed once training runs -> the next start's first progress record (recovery_timing.py), and the
    same from the job's log. Today's path (in_place False) reads the image from the shared folder, as pyxis
    does without ddpack; ddpack's path stages as DDPACK_STAGE=auto decides."""
    folder.mkdir(parents=True, exist_ok=True)
    job, metrics, log = submit(
        folder, name, ("--ntasks-per-node=2",), "pyxis-per-task.sbatch",
        DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_RESTART_IN_PLACE="1" if in_place else "0",
        DDPACK_TRAIN_ARGS=TRAIN, **({} if in_place else {"DDPACK_STAGE": "off"}),
    )  # fmt: skip
    try:
        wait_for_progress(metrics, 30, log, f"the {name} job did not train", timeout=900)
        skip, killed = log_length(log), time.time()
        if not signal_tasks(job, "ddnode2", signal.SIGKILL, rank=3):
            sys.exit("bench_goodput: no rank 3 on ddnode2")
        try:
            return follow(metrics, log, killed, skip, timeout=900)
        except TimeoutError as exc:
            sys.exit(f"bench_goodput: the {name} job: {exc} ({job_state(job)}); see {log}")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        wait_for_end(job, log)


def measured_site(*, fsx_mbps: float, size_mb: float, sbcast_mbps: list[float], unpack_mbps: float, requeue: Recovery, in_place: Recovery) -> Site:
    """The model's per-node figures from this bench's: the restart in place is detect + a step's start (assumed,
    Site.step_s) + the trainer's start; a requeue is that plus the wait for Slurm to start the job again and a
    second unpack. A figure that comes out zero or less is refused: it would stand in the table as a measurement."""
    if in_place.detect_s is None:
        raise ImplausibleRecovery(f"no detection time for the restart in place ({in_place.ended}): rank 3's kill leaves rank 0 its end record")
    trainer_s = in_place.back_s - in_place.detect_s - Site().step_s
    requeue_s = requeue.back_s - in_place.back_s - size_mb / unpack_mbps
    derived = (
        ("the trainer's start (in place: back - detect - a step's start)", trainer_s),
        ("the requeue's wait (requeue back - in place back - an unpack)", requeue_s),
    )
    for what, seconds in derived:
        if not seconds > 0:
            raise ImplausibleRecovery(f"{what} comes out {seconds:.2f} s from requeue {requeue} and in place {in_place}")
    return Site(
        fsx_mbps=fsx_mbps,
        sbcast_mbps=statistics.median(sbcast_mbps) if sbcast_mbps else Site().sbcast_mbps,
        unpack_mbps=unpack_mbps,
        detect_s=in_place.detect_s,
        trainer_s=trainer_s,
        requeue_s=requeue_s,
    )


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
    parser.add_argument("--fsx-mbps", type=float, default=Site().fsx_mbps, help="the model's shared-filesystem throughput, all nodes together")
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
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"goodput at {commit or '?'}: {opts.sqsh} ({size_mb:,.0f} MB), pyxis-per-task.sbatch, 4 ranks on 2 nodes, trainer {TRAIN}", flush=True)
    try:
        starts: dict[str, list[dict[str, float | str]]] = {"shared (today)": [], "staged, cold": [], "staged, warm": []}
        for round_ in range(opts.rounds):
            for label, stage in (("shared (today)", "off"), ("staged, cold", "sbcast"), ("staged, warm", "sbcast")):
                if label == "staged, cold":
                    clear_staged_images()
                starts[label].append(start(shared / f"s{round_}-{stage}", sqsh, shared, stage, f"start-{round_}"))
                print(f"goodput: start round {round_ + 1}, {label}: {starts[label][-1]}", flush=True)
        backs = {"requeue (today)": recovery(shared / "rq", sqsh, shared, False, "requeue"), "in place": recovery(shared / "ip", sqsh, shared, True, "inplace")}
        for label, figures in backs.items():
            print(f"goodput: recovery, {label}: {figures}", flush=True)
        unpack = statistics.median(unpack_mbps(sqsh) for _ in range(2))
    finally:
        clear_staged_images()
        shutil.rmtree(shared, ignore_errors=True)

    print(f"\nstart: sbatch -> first training step ({opts.rounds} interleaved rounds, medians)")
    shared_s = statistics.median(r["start_s"] for r in starts["shared (today)"])
    for label, rows in starts.items():
        median = statistics.median(r["start_s"] for r in rows)
        extra = f"  (sbcast {statistics.median(r['sbcast_s'] for r in rows):.1f} s)" if all("sbcast_s" in r for r in rows) else ""
        print(f"  {label:<16} {median:>7.1f} s   {median / shared_s:.2f}x today{extra}")
        for round_, r in enumerate(rows, 1):  # a row whose job took another path than its label says is not that path's figure
            if (label == "staged, cold") != ("sbcast_s" in r):
                print(f"    NOT {label.upper()} in round {round_}: the job's image line says {r['image']!r}")
    print("recovery: rank 3 SIGKILLed -> training again (seconds after the kill: from rank 0's records; back also as timed from the job log)")
    for label, r in backs.items():
        detect = f"{r.detect_s:>5.2f} s" if r.detect_s is not None else "  n/a  "
        check = "agrees" if r.log_agrees else "DISAGREES by more than a third"
        print(
            f"  {label:<16} detect {detect} ({r.ended})   decided {r.decided_s:>5.1f} s   back {r.back_s:>6.1f} s   "
            f"log: kill -> restart's first progress line {r.log_back_s:>6.1f} s ({check})   replayed {r.replayed} steps"
        )
    ratio = backs["in place"].back_s / backs["requeue (today)"].back_s
    print(f"  in place / requeue: {ratio:.2f}x; its floor is the trainer's start (imports, rendezvous, the snapshot, the first step)")
    sbcast = [r["sbcast_mbps"] for r in starts["staged, cold"] if "sbcast_mbps" in r]
    site = measured_site(
        fsx_mbps=opts.fsx_mbps, size_mb=size_mb, sbcast_mbps=sbcast, unpack_mbps=unpack,
        requeue=backs["requeue (today)"], in_place=backs["in place"],
    )  # fmt: skip
    print(f"\nmodel (ddpack/jobs/goodput_model.py), per-node figures measured here: {site}")
    print(table(site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
