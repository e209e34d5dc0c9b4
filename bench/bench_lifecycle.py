"""What `ddpack submit` and `ddpack status` cost a user, beside their floors, side by side (A B A B ..., medians).

- submit, nothing changed: `ddpack submit` of a project whose image and squashfs exist already (no build, no copy),
  against the floor, plain `sbatch` of the same job script. The difference is ddpack's own work: reading the
  project (hashing its files), finding the image, checking the squashfs, the checks, the record.
- status on a long run: `ddpack status --json` of a run folder with 100,000 progress records, against the floor
  (`tail -n 1` of the metrics file and one `squeue`), and against reading every record as JSON (ddpack's report
  reader, what a status built on it would pay).

Needs the test cluster (testbed/slurm_cluster.py) and a Docker engine; the first submit builds the README's
project once (minutes), the rounds after it are what is measured. Jobs are cancelled as soon as they are queued.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpack.jobs.run_metrics import read_run
from testbed.env import clean_env
from testbed.readme_examples import write_cpu_ddp
from testbed.slurm_cluster import ensure_cluster

DDPACK = str(Path(sys.executable).parent / "ddpack")


def timed(argv: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess[str]]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=clean_env(), **kwargs)
    return time.perf_counter() - started, out


def submit_rounds(work: Path, rounds: int) -> tuple[list[float], list[float]]:
    project = work / "cpu-ddp"
    write_cpu_ddp(project)
    (work / "images").mkdir(exist_ok=True)
    args = [DDPACK, "submit", str(project), "--nodes", "2", "--tasks-per-node", "2", "--runs", str(work / "runs"),
            "--images", str(work / "images"), "--mounts", f"{work}:/fsx", "--json", "--", "python", "ddp.py", "4", "2"]  # fmt: skip
    _, first = timed(args, timeout=3600)  # builds and converts once
    assert first.returncode == 0, first.stderr[-3000:]
    script = json.loads(first.stdout)["script"]
    subprocess.run(["scancel", json.loads(first.stdout)["job_id"]], capture_output=True)
    ours, floor = [], []
    for _ in range(rounds):
        seconds, out = timed(args, timeout=600)
        assert out.returncode == 0 and '"built": false' in out.stdout and '"converted": false' in out.stdout, out.stdout + out.stderr
        subprocess.run(["scancel", json.loads(out.stdout)["job_id"]], capture_output=True)
        ours.append(seconds)
        seconds, out = timed(["sbatch", "--parsable", script], timeout=120)
        assert out.returncode == 0, out.stderr
        subprocess.run(["scancel", out.stdout.strip().split(";")[0]], capture_output=True)
        floor.append(seconds)
    return ours, floor


def long_run(folder: Path, records: int) -> Path:
    """A run folder as `ddpack submit` makes it, with `records` progress records from the bundled trainer."""
    from ddpack.jobs.run_json import Job, RunRecord, write_record

    run_dir = folder / "runs" / "long-run"
    (run_dir / "logs").mkdir(parents=True)
    write_record(
        RunRecord(
            name=run_dir.name, run_dir=str(run_dir), created=time.time(), user="me", host="login", image={}, sqsh={}, code={},
            command=[], settings={}, script="job/ddpack.sbatch", script_sha256="", versions={},
            jobs=[Job(job_id="999999", attempt=1, submitted=time.time(), how="submit")],
        )
    )  # fmt: skip
    with (run_dir / "metrics.jsonl").open("w") as handle:
        handle.write(json.dumps({"time": 0.0, "kind": "start", "hosts": ["n1", "n2"], "global_step": 0, "total_steps": 2 * records}) + "\n")
        for step in range(1, records + 1):
            record = {"time": step * 0.1, "kind": "progress", "epoch": 0, "step": step, "global_step": step, "loss": 1 / step,
                      "lr": 0.001, "samples_per_s": 2000.0, "mfu": 0.3, "eta_s": records * 0.1,
                      "rank_step_s": [0.01] * 8, "rank_data_s": [0.001] * 8, "rank_sync_s": [0.002] * 8}  # fmt: skip
            handle.write(json.dumps(record) + "\n")
    return run_dir


def status_rounds(run_dir: Path, rounds: int) -> tuple[list[float], list[float], list[float]]:
    ours, floor, full = [], [], []
    for _ in range(rounds):
        seconds, out = timed([DDPACK, "status", str(run_dir), "--json"], timeout=120)
        assert out.returncode == 0, out.stderr
        ours.append(seconds)
        started = time.perf_counter()
        subprocess.run(["tail", "-n", "1", str(run_dir / "metrics.jsonl")], capture_output=True)
        subprocess.run(["squeue", "-h", "-t", "all", "-j", "999999"], capture_output=True)
        floor.append(time.perf_counter() - started)
        started = time.perf_counter()
        read_run(run_dir)
        full.append(time.perf_counter() - started)
    return ours, floor, full


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--skip-submit", action="store_true", help="status alone (no Docker build, no cluster jobs)")
    opts = parser.parse_args()
    ensure_cluster()
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-lifecycle-", dir="/tmp") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        if not opts.skip_submit:
            ours, floor = submit_rounds(work, opts.rounds)
            print(f"submit, nothing changed ({opts.rounds} rounds, A B A B): ddpack submit {statistics.median(ours):.2f} s, "
                  f"plain sbatch {statistics.median(floor):.2f} s; ddpack's own work {statistics.median(ours) - statistics.median(floor):.2f} s "
                  f"(target: within ~2 s)")  # fmt: skip
        run_dir = long_run(work, opts.records)
        size = (run_dir / "metrics.jsonl").stat().st_size
        ours, floor, full = status_rounds(run_dir, opts.rounds)
        print(f"status, {opts.records:,} progress records ({size / 2**20:.0f} MiB, {opts.rounds} rounds): ddpack status "
              f"{statistics.median(ours):.2f} s (target: ~1 s); floor (tail -n 1 + squeue) {statistics.median(floor):.3f} s; "
              f"every record parsed (report's reader, in-process) {statistics.median(full):.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
