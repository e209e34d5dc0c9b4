"""What experiments cost in ddpack's own work, beside their floors, side by side (A B A B ..., medians).

- A sweep of 100 points against one run: `ddpack submit --sweep` (100 run folders and records, one job array) and a
  plain `ddpack submit` of the same project, both with `--sqsh` (no image to build: the build is the same one for
  both). The difference is what the sweep costs beyond its one build; the target is at most 3 s. Also beside it:
  100 plain submits, what a sweep without arrays would cost (measured on 10, times 10).
- `ddpack ls` on 1,000 runs, each with its record, a few progress records and a log; the target is at most 1 s.
  Two cases: squeue lists every job (RUNNING), and squeue lists none (all ended and purged: each run's state is then
  read from its folder, the careful path, once: the run keeps a summary). The floor is reading every run.json
  (`cat */run.json`).
- `ddpack ls` on 1,000 ended runs whose metrics files are 10 MB and logs 1 MB each (padded past their records as
  sparse files, so the bench needs no 11 GB of disk): the first ls (cold: every file read, each run's summary
  written), then the warm ones, which read run.json and summary.json alone; the target is at most 1 s warm.
- `ddpack ls` on 1,000 runs, 100 of them running (squeue lists them) with 20 MB of real metrics records and a 20 MB
  log each, the others ended (their summaries written): a live run's metrics are glanced at (head and tail), its
  log not read; the target is at most 1 s.
- `ddpack compare SWEEP` and `ddpack export SWEEP --summary` of 100 points with 20 MB of real metrics records each
  (the trainer's fields, 8 ranks): the first compare reads and scans each point's file once, a process a core, and
  keeps its digest (metrics_scan.digest_stale, read_digest); compare again and export --summary read the digests of
  the files unchanged since. Each round starts from no digest (the first compare and the first export --summary are
  the figures the target of at most 5 s is about), and the first compare's CPU is printed beside its floor on this
  host's cores. The floor of reading alone is reading the files (`cat`).

Slurm's commands are stand-ins that answer at once (what is timed is ddpack, not a controller), so it needs no
cluster. Run: make bench-experiments (BENCH_EXPERIMENTS_ARGS="--rounds 5").
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

DDPACK = str(Path(sys.executable).parent / "ddpack")
FAKES = {
    "sbatch": '[ "$1" = --test-only ] && exit 0; echo 4242',
    "srun": "echo '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'",
    "sinfo": 'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) echo "debug*|64|idle|(null)" ;; esac',
    "sacct": "exit 1",
    "scontrol": "exit 1",
    "enroot": "echo 3.4.1",
}


def fake_slurm(folder: Path, squeue: str) -> dict[str, str]:
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in {**FAKES, "squeue": squeue}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return seconds


def sweep_rounds(work: Path, rounds: int) -> dict[str, list[float]]:
    env = fake_slurm(work, "exit 0")
    sqsh = work / "images" / "x.sqsh"
    sqsh.parent.mkdir()
    sqsh.write_bytes(b"hsqs" + b"\0" * 4096)
    (work / "project").mkdir()
    base = [DDPACK, "submit", str(work / "project"), "--nodes", "2", "--runs", str(work / "runs"), "--sqsh", str(sqsh),
            "--mounts", f"{work}:/fsx", "--json", "--"]  # fmt: skip
    values = ",".join(f"{i}e-4" for i in range(1, 11))
    sweep = [*base[:-1], "--sweep", f"lr={values}", "--sweep", f"seed={','.join(map(str, range(10)))}", "--",
             "python", "train.py", "--lr", "{lr}", "--seed", "{seed}"]  # fmt: skip
    single = [*base, "python", "train.py", "--lr", "1e-4", "--seed", "0"]
    times: dict[str, list[float]] = {"sweep of 100": [], "one submit": [], "10 submits": []}
    for _ in range(rounds):
        times["sweep of 100"].append(timed(sweep, env))
        times["one submit"].append(timed(single, env))
        started = time.perf_counter()
        for _ in range(10):
            timed(single, env)
        times["10 submits"].append(time.perf_counter() - started)
    return times


def many_runs(work: Path, count: int, metrics_mb: float = 0, log_mb: float = 0) -> Path:
    """`count` run folders as submit leaves them after a short run: run.json, metrics (start, 3 progress, end), a log;
    each file padded (sparse) to `metrics_mb` and `log_mb` when given."""
    from ddpack.jobs.run_json import Job, RunRecord, write_record

    runs = work / "runs"
    for index in range(count):
        run_dir = runs / f"run-{index:04d}"
        (run_dir / "logs").mkdir(parents=True)
        job = str(10000 + index)
        write_record(
            RunRecord(
                name=run_dir.name, run_dir=str(run_dir), created=1e9 + index, user="me", host="login", image={"ref": "x"}, sqsh={},
                code={}, command=["python", "train.py"], settings={"nodes": 2}, script="job/ddpack.sbatch", script_sha256="",
                versions={}, jobs=[Job(job_id=job, attempt=1, submitted=1e9 + index, how="submit")],
            )
        )  # fmt: skip
        records = [{"time": 1e9 + index, "kind": "start", "global_step": 0, "total_steps": 30, "hosts": ["n1", "n2"]}]
        records += [{"time": 1e9 + index + s, "kind": "progress", "global_step": s * 10, "loss": 1.0 / s} for s in (1, 2, 3)]
        records.append({"time": 1e9 + index + 4, "kind": "end", "outcome": "done", "exit_code": 0, "global_step": 30})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "logs" / f"slurm-{job}.out").write_text(f"ddpack: job {job} on n[1-2]\n[rank 0/4] step 30\n")
        for path, size in ((run_dir / "metrics.jsonl", metrics_mb), (run_dir / "logs" / f"slurm-{job}.out", log_mb)):
            if size:
                os.truncate(path, int(size * 2**20))  # NULs after the last line: read as one line that is no record
    return runs


def ls_rounds(work: Path, count: int, rounds: int) -> dict[str, list[float]]:
    runs = many_runs(work, count)
    listed = "\n".join(f"{10000 + i}|RUNNING" for i in range(count))
    (work / "listed.txt").write_text(listed + "\n")
    running = fake_slurm(work / "running", f'case "$*" in *%i*) cat {work / "listed.txt"} ;; *) echo "RUNNING||n1" ;; esac')
    ended = fake_slurm(work / "ended", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    times: dict[str, list[float]] = {"ls, squeue lists all": [], "ls, squeue lists none": [], "floor: cat every run.json": []}
    for _ in range(rounds):
        times["ls, squeue lists all"].append(timed([DDPACK, "ls", "--runs", str(runs), "--json"], running))
        times["ls, squeue lists none"].append(timed([DDPACK, "ls", "--runs", str(runs), "--json"], ended))
        times["floor: cat every run.json"].append(timed(["bash", "-c", f"cat {runs}/*/run.json > /dev/null"], running))
    return times


def big_rounds(work: Path, count: int, rounds: int) -> dict[str, list[float]]:
    runs = many_runs(work, count, metrics_mb=10, log_mb=1)
    ended = fake_slurm(work / "ended", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    argv = [DDPACK, "ls", "--runs", str(runs), "--json"]
    times: dict[str, list[float]] = {"ls, cold (summaries written)": [timed(argv, ended)], "ls, warm": []}
    for _ in range(rounds):
        times["ls, warm"].append(timed(argv, ended))
    return times


def big_metrics(path: Path, megabytes: float) -> None:
    """A metrics file as the trainer writes one, `megabytes` long: a start, then progress records (every field the
    trainer's carry, 8 ranks' step times), an eval every 1,000 steps, and an end."""
    progress = {"time": 0.0, "kind": "progress", "epoch": 0, "step": 0, "global_step": 0, "loss": 0.5, "lr": 3e-4, "grad_norm": 1.2,
                "samples_per_s": 2000.0, "tokens_per_s": 1.2e6, "mfu": 0.41, "eta_s": 100.0, "data_s": 0.001, "forward_s": 0.01,
                "backward_s": 0.02, "optimizer_s": 0.003, "step_s": 0.04, "rank_step_s": [0.04] * 8}  # fmt: skip
    steps = int(megabytes * 2**20 / (len(json.dumps(progress)) + 12))
    lines = [json.dumps({"time": 1e9, "kind": "start", "global_step": 0, "total_steps": steps, "hosts": ["n1", "n2"]})]
    for step in range(1, steps + 1):
        lines.append(
            json.dumps({**progress, "time": 1e9 + step, "global_step": step, "loss": 1.0 / step, "samples_per_s": 2000.0 + step % 7})
        )
        if step % 1000 == 0:
            lines.append(json.dumps({"time": 1e9 + step, "kind": "eval", "global_step": step, "eval_loss": 1.0 / step}))
    lines.append(json.dumps({"time": 1e9 + steps + 1, "kind": "end", "outcome": "done", "exit_code": 0, "global_step": steps}))
    path.write_text("\n".join(lines) + "\n")


def compare_rounds(work: Path, points: int, megabytes: float, rounds: int) -> dict[str, list[float]]:
    """`compare SWEEP` and `export SWEEP --summary` of a sweep of `points` points whose metrics are `megabytes` each
    (one file written, the points' hard links to it: the same bytes to read and parse a point, less disk)."""
    env = fake_slurm(work, "exit 0")
    sqsh = work / "images" / "x.sqsh"
    sqsh.parent.mkdir()
    sqsh.write_bytes(b"hsqs" + b"\0" * 4096)
    (work / "project").mkdir()
    out = subprocess.run([DDPACK, "submit", str(work / "project"), "--nodes", "1", "--runs", str(work / "runs"), "--sqsh", str(sqsh),
                          "--mounts", f"{work}:/fsx", "--json", "--sweep", f"i={','.join(map(str, range(points)))}", "--", "p", "{i}"],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    sweep = Path(json.loads(out.stdout[out.stdout.index("{") :])["run_dir"])
    big_metrics(work / "metrics.jsonl", megabytes)
    for index in range(points):
        os.link(work / "metrics.jsonl", sweep / str(index) / "metrics.jsonl")
    compare = [DDPACK, "compare", str(sweep), "--json"]
    export = [DDPACK, "export", str(sweep), "--summary", str(work / "runs.csv")]
    times: dict[str, list[float]] = {"compare SWEEP, first": [], "compare SWEEP, first, CPU": [], "compare SWEEP, again": [],
                                     "export SWEEP --summary, first": [], "export SWEEP --summary": [],
                                     "floor: cat every metrics": []}  # fmt: skip
    for _ in range(rounds):  # each round from no digest: the first read is the figure the target is about
        forget_digests(sweep)
        cpu = children_cpu()
        times["compare SWEEP, first"].append(timed(compare, env))
        times["compare SWEEP, first, CPU"].append(children_cpu() - cpu)
        times["compare SWEEP, again"].append(timed(compare, env))
        forget_digests(sweep)
        times["export SWEEP --summary, first"].append(timed(export, env))
        times["export SWEEP --summary"].append(timed(export, env))
        times["floor: cat every metrics"].append(timed(["bash", "-c", f"cat {sweep}/*/metrics.jsonl > /dev/null"], env))
    return times


def forget_digests(sweep: Path) -> None:
    """Remove each point's kept digest (run_metrics.DIGEST), so the next read is a first read."""
    from ddpack.jobs.run_metrics import DIGEST

    for digest in sweep.glob(f"*/{DIGEST}"):
        digest.unlink()


def children_cpu() -> float:
    """CPU seconds (user and system) of every child process this one has waited for: what a timed command used,
    its worker processes included, taken as a difference."""
    used = os.times()
    return used.children_user + used.children_system


def live_rounds(work: Path, count: int, live: int, megabytes: float, rounds: int) -> dict[str, list[float]]:
    """`ls` of `count` runs, `live` of them running (squeue lists them) with `megabytes` of real metrics records and a
    log as long; the others ended, their summaries written by a first ls (not timed)."""
    runs = many_runs(work, count)
    big_metrics(work / "metrics.jsonl", megabytes)
    for index in range(live):
        run_dir = runs / f"run-{index:04d}"
        (run_dir / "metrics.jsonl").unlink()
        os.link(work / "metrics.jsonl", run_dir / "metrics.jsonl")
        os.truncate(run_dir / "logs" / f"slurm-{10000 + index}.out", int(megabytes * 2**20))
    (work / "listed.txt").write_text("".join(f"{10000 + i}|RUNNING\n" for i in range(live)))
    settle = fake_slurm(work / "first", f'case "$*" in *%i*) cat {work / "listed.txt"} ;; *) exit 0 ;; esac')
    timed([DDPACK, "ls", "--runs", str(runs), "--json"], settle)  # the ended runs' summaries
    times: dict[str, list[float]] = {f"ls, {live} live of {count}": []}
    for _ in range(rounds):
        times[f"ls, {live} live of {count}"].append(timed([DDPACK, "ls", "--runs", str(runs), "--json"], settle))
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    for name, values in times.items():
        print(f"  {name:28} median {statistics.median(values):7.3f} s   (runs: {', '.join(f'{v:.3f}' for v in values)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=1000, help="run folders for ls")
    parser.add_argument("--big-runs", type=int, default=1000, help="ended run folders with 10 MB metrics and 1 MB logs, for ls")
    parser.add_argument("--points", type=int, default=100, help="a sweep's points for compare and export --summary")
    parser.add_argument("--point-mb", type=float, default=20, help="each point's metrics, MB")
    parser.add_argument("--compare-rounds", type=int, default=3, help="rounds of compare and export, each from no digest")
    parser.add_argument("--live", type=int, default=100, help="of --runs, how many are running with big files, for ls")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-experiments-") as folder:
        work = Path(folder)
        (work / "sweep").mkdir()
        sweep = sweep_rounds(work / "sweep", opts.rounds)
        report("ddpack submit, a sweep of 100 points vs one run (--sqsh: no build; fake Slurm answering at once):", sweep)
        extra = statistics.median(sweep["sweep of 100"]) - statistics.median(sweep["one submit"])
        print(f"  the sweep's own work beyond one submit: {extra:.2f} s (target <= 3 s); 100 plain submits would take "
              f"{statistics.median(sweep['10 submits']) * 10:.1f} s")  # fmt: skip
        (work / "ls").mkdir()
        listing = ls_rounds(work / "ls", opts.runs, opts.rounds)
        report(f"ddpack ls --json on {opts.runs} runs (target <= 1 s):", listing)
        (work / "big").mkdir()
        big = big_rounds(work / "big", opts.big_runs, opts.rounds)
        report(f"ddpack ls --json on {opts.big_runs} ended runs with 10 MB metrics and 1 MB logs each (target <= 1 s warm):", big)
        (work / "live").mkdir()
        live = live_rounds(work / "live", opts.runs, min(opts.live, opts.runs), opts.point_mb, opts.rounds)
        report(
            f"ddpack ls --json on {opts.runs} runs, {min(opts.live, opts.runs)} running with {opts.point_mb:g} MB metrics and logs (target <= 1 s):",
            live,
        )
        (work / "compare").mkdir()
        compared = compare_rounds(work / "compare", opts.points, opts.point_mb, opts.compare_rounds)
        report(
            f"ddpack compare / export --summary of a sweep of {opts.points} points, {opts.point_mb:g} MB of metrics each (target <= 5 s):",
            compared,
        )
        cores = len(os.sched_getaffinity(0))
        cpu = statistics.median(compared["compare SWEEP, first, CPU"])
        print(f"  the first compare's CPU {cpu:.2f} s ({cpu / opts.points * 1000:.0f} ms a point) on {cores} cores: its floor here "
              f"{cpu / cores:.2f} s, against {statistics.median(compared['compare SWEEP, first']):.2f} s taken")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
