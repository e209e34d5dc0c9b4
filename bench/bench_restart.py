"""A killed rank trained again in place: the job program at a revision against the one now, side by side (issue 48,
point 7), and where the seconds go.

Each round runs, for each side in turn (A B A B ...), one job of the bundled trainer through that side's own
enroot/baremetal.sbatch (its ddpack-job.sh and job program beside it, DDPACK_HOME): 4 ranks on 2 of the test cluster's
nodes, --snapshot-every 10. Once it trains, rank 3 is SIGKILLed (the OOM killer) and the job is followed
(recovery_timing.follow) until the restarted step trains:

- detect: the failure -> the failing segment's end record (rank 0's collective failed: it knows);
- decided: -> the job's decision in its log ("restarting it in this allocation"): the step has ended (srun waits for
  the survivors, which end on the failed collective) and the job program has decided;
- started: -> the restarted segment's start record: srun's new step, then the trainer's start (a process, `import
  torch`, the rendezvous, the snapshot's load);
- back: -> its first progress record (the first step too).

Medians per side, and now/before. The floor of started - decided is a step whose 4 tasks start Python and `import
torch` (timed here: the test nodes share this host's cores), then the rendezvous and the snapshot's load.

    python bench/bench_restart.py [--before fa34be6] [--rounds 3] [--sqsh build/IMAGE.sqsh]

`--local` (no Slurm): today's path against in-process recovery (issue 56, train/recovery.py) on this host, A B A B, 4
ranks in the per-task shape (what srun or docker -e gives each rank), rank 3 SIGKILLed once past step LOCAL_KILL_AT:
- restart (today): the survivors are ended at once (srun ends a step's tasks when one fails), 4 new processes start,
  `import torch`, rendezvous, load the newest snapshot (--snapshot-every 10) and train again: `start` is the kill ->
  the new segment's start record, `back` -> its first progress record, `past` -> the first progress record past the
  step the kill interrupted (the replayed steps included);
- in-process (--recovery, one --standby): `notice` is the kill -> the survivor's failed collective (the collective
  timeout), then the recovery record's own stages (decide, abort, new group, state, first step), `back` -> the first
  progress record after the failure (the redone step; nothing is replayed, so `past` is `back`).

    python bench/bench_restart.py --local [--rounds 2]

`--standbys` (the test cluster, this revision): the same two paths through a template, A B A B: today's restart in place
(DDPACK_STANDBYS=0) against in-process recovery (DDPACK_STANDBYS=1: a standby task in the training step), 4 ranks on 2
nodes, rank 3 SIGKILLed while training past step 30: `back` is the kill -> the first progress record after it, `past`
-> the first past the step the kill interrupted, `replayed` the steps trained twice; in-process also gives its recovery
record's stages (notice: the kill -> the survivors' failed collective).

    python bench/bench_restart.py --standbys [--rounds 2] [--sqsh build/IMAGE.sqsh] [--kill-rank 0] [--second-death]

`--kill-rank 0`: rank 0 is the one SIGKILLed (in-process: the store task serves the store, so its standby takes rank 0's
place). `--second-death`: in-process, once the store task's new standby (started for the one the first recovery
consumed) is warm, rank 2 is SIGKILLed too, and the row is that second death's; today's side is one kill, as ever.
`twice` counts the global steps with more than one progress record (steps trained twice).

`--node-down` (with `--standbys`): a whole node lost instead of a rank: 3 nodes of partition `big`, one a spare
(DDPACK_SPARE_NODES=1), ddnode2 set DOWN (`scontrol update ... state=down`, as a health agent does) and its tasks
SIGKILLed while training past step 30; today's side (DDPACK_STANDBYS=0) is the spare swap, a restart of the step on
ddnode1 and the spare from the last snapshot; in-process (the spare hosts 2 standbys, a node's ranks) the spare's
standbys take ranks 2 and 3 in the same step. Times are from the DOWN; the node is resumed after each job.

    python bench/bench_restart.py --standbys --node-down [--rounds 2] [--sqsh build/IMAGE.sqsh]

`--after STEPS` (with `--standbys`): the world after a recovery, A B A B: one job with a standby left alone, one with
rank 1 SIGKILLed past step 30 and replaced in process, each the median samples/s over the same STEPS steps from step 41
(the issue's 0.66x was 300 steps), and their ratio (goal: at least 0.9x).

    python bench/bench_restart.py --standbys --after 300 [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.recovery_timing import follow, log_length, read_metrics  # noqa: E402
from testbed.slurm_jobs import env, signal_tasks, wait_for_progress  # noqa: E402

TRAIN_ARGS = "--dataset-size 32768 --epochs 3 --log-every 1 --snapshot-every 10 --hang-timeout 30"
NODES = ("ddnode1", "ddnode2", "ddnode3")


def enroot_at(revision: str, into: Path) -> Path:
    """enroot/ as it was at `revision` (templates, helper, job program), in a folder of its own."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "enroot"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "enroot"


@contextlib.contextmanager
def submitted(enroot: Path, folder: Path, sqsh: Path | None, name: str, settings: str, spares: int = 0) -> Iterator[tuple[str, Path, Path]]:
    """A 2 x 2 job of the bare-metal template (with `sqsh`: pyxis-per-task.sbatch in that image) with the bench's
    training and `settings` exported, and `spares` spare nodes more (partition big); (job id, its metrics file, its
    log) while it lives, cancelled and gone after."""
    (folder / "logs").mkdir(parents=True)
    exports = (
        f"ALL,DDPACK_TRAIN_ARGS={TRAIN_ARGS},{settings},DDPACK_MAX_FAILURE_RESTARTS=1,DDPACK_HOME={enroot},DDPACK_SPARE_NODES={spares}"
    )
    template = "baremetal.sbatch"
    if sqsh is not None:
        exports += f",DDPACK_SQSH={sqsh},DDPACK_MOUNTS=/tmp:/tmp"
        template = "pyxis-per-task.sbatch"
    job = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", f"--export={exports}", f"--nodes={2 + spares}", "--ntasks-per-node=2",
         *(["--partition=big"] if spares else []), str(enroot / template)],
        cwd=folder, capture_output=True, text=True, check=True, env=env(OMP_NUM_THREADS="1"),
    ).stdout.strip()  # fmt: skip
    try:
        yield job, folder / "runs" / f"{name}-{job}" / "metrics.jsonl", folder / "logs" / f"{name}-{job}.out"
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            time.sleep(0.5)


def one_restart(enroot: Path, folder: Path, sqsh: Path | None) -> dict[str, float]:
    """One job, one killed rank, the seconds after it (see the module's docstring); with `sqsh`, through
    pyxis-per-task.sbatch in that image (the restarted step starts in the job's container, already unpacked)."""
    with submitted(enroot, folder, sqsh, "restart", "DDPACK_STEP_WAIT=30") as (job, metrics, log):
        wait_for_progress(metrics, 30, log, "the job did not train", timeout=300)
        skip, failed_at = log_length(log), time.time()
        if not any(signal_tasks(job, node, signal.SIGKILL, rank=3) for node in NODES):
            raise SystemExit(f"bench_restart: job {job} has no rank 3; see {log}")
        recovery = follow(metrics, log, failed_at, skip, timeout=300)
        starts = [r["time"] for r in read_metrics(metrics) if r["kind"] == "start" and r["time"] > failed_at]
    return {
        "detect": recovery.detect_s if recovery.detect_s is not None else float("nan"),
        "decided": recovery.decided_s,
        "started": starts[0] - failed_at if starts else float("nan"),
        "back": recovery.back_s,
    }


def training_again(every: list[dict], killed_at: float) -> tuple[dict, dict, int, list[dict]] | None:
    """After a kill at `killed_at`: (the first progress record of training again, the first past the step the kill
    interrupted, the step the old segment had reached, the records from the boundary on), or None while there are
    none yet. Training again starts at the new segment's start record (today's restart) or at the recovery record
    (written in the redone step, before its progress record): a survivor may still log a step whose collective
    completed just before the kill, after the kill and before the boundary, and that is not training again."""
    boundary = next((i for i, r in enumerate(every) if r["time"] > killed_at and r["kind"] in ("start", "recovery")), None)
    if boundary is None:
        return None
    reached = max(r["global_step"] for r in every[:boundary] if r["kind"] == "progress")
    after = [r for r in every[boundary:] if r["kind"] == "progress"]
    past = next((r for r in after if r["global_step"] > reached), None)
    return None if past is None else (after[0], past, reached, every[boundary:])


def warm(job: str, log: Path, standbys: int) -> None:
    """Until `standbys` standbys have said they are warm in the job's log."""
    deadline = time.monotonic() + 120
    while log.read_text().count("warm, watching") < standbys:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_restart: job {job}'s standby is not warm; see {log}")
        time.sleep(0.1)


def kill_task(job: str, log: Path, task: int) -> float:
    """SIGKILL the launcher's task `task` (SLURM_PROCID) of the job's training step; the wall clock of the kill."""
    killed_at = time.time()
    if not any(signal_tasks(job, node, signal.SIGKILL, rank=task) for node in NODES):
        raise SystemExit(f"bench_restart: job {job} has no task {task}; see {log}")
    return killed_at


def lose_node(job: str, node: str = "ddnode2") -> float:
    """`node` set DOWN, as a health agent does, and the job's tasks there SIGKILLed, as a node that fails takes them;
    the wall clock of the DOWN."""
    lost_at = time.time()
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=bench-restart-node-down"], check=True)
    signal_tasks(job, node, signal.SIGKILL)  # Slurm may have killed them already
    return lost_at


def one_kill(
    enroot: Path, folder: Path, sqsh: Path | None, standbys: int, rank: int, second: bool, node_down: bool = False
) -> dict[str, float]:
    """One job of the template with DDPACK_STANDBYS=`standbys`, rank `rank` SIGKILLed while it trains (and with `second`,
    rank 2 once a new standby is warm; with `node_down`, ddnode2 lost instead, with a spare); the seconds after the last
    kill (see `--standbys` and `--node-down` in the module's docstring)."""
    spares = 1 if node_down else 0
    with (
        resumed("ddnode2" if node_down else None),  # outermost: the node is resumed once the job is gone
        submitted(enroot, folder, sqsh, "kill", f"DDPACK_STANDBYS={standbys}", spares) as (job, metrics, log),
    ):
        wait_for_progress(metrics, 30, log, "the job did not train", timeout=300)
        warm(job, log, 2 * standbys if node_down else standbys)
        killed_at = lose_node(job) if node_down else kill_task(job, log, rank)
        if second:
            warm(job, log, standbys + 1)  # the store task's new standby
            killed_at = kill_task(job, log, 2)
        deadline = time.monotonic() + 300
        while (again := training_again(read_metrics(metrics), killed_at)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_restart: job {job} did not train again past the step the kill interrupted; see {log}")
            time.sleep(0.05)
        time.sleep(2)  # a few steps more: a step trained twice shows
        steps = [r["global_step"] for r in read_metrics(metrics) if r["kind"] == "progress"]
    back, past, reached, records = again
    row = {"back": back["time"] - killed_at, "past": past["time"] - killed_at}
    starts = [r for r in records if r["kind"] == "start"]
    row["replayed"] = reached - starts[0]["global_step"] if starts else 0
    row["twice"] = len(steps) - len(set(steps))
    recovery = next((r for r in records if r["kind"] == "recovery"), None)
    if recovery is not None:
        row |= {
            "notice": recovery["failed_at"] - killed_at,
            **{k[:-2]: recovery[k] for k in ("decide_s", "abort_s", "new_group_s", "state_s", "first_step_s")},
        }
    elif standbys:
        said = [line for line in log.read_text().splitlines() if "step " not in line or "recovery" in line]  # no progress lines
        raise SystemExit(f"bench_restart: job {job} did not recover in process; its log without progress lines:\n" + "\n".join(said[-60:]))
    return row


AFTER_FROM = 40  # the throughput window's first step is the next: past the kill at step 30 and its recovery


def kept(log: Path) -> Path:
    """A copy of a failed job's log and run folder (the bench's own folder goes as the bench ends)."""
    path = Path(tempfile.mkdtemp(prefix="ddpack-bench-kept-", dir="/tmp"))
    shutil.copytree(log.parent.parent, path, dirs_exist_ok=True)
    return path


def one_after(enroot: Path, folder: Path, sqsh: Path | None, killed: bool, window: int) -> tuple[float, list[float]]:
    """The median samples/s over global steps AFTER_FROM + 1 to AFTER_FROM + `window` of one job with a standby (on
    ddnode1, beside ranks 0 and 1): rank 1 SIGKILLed once it trains past step 30 and replaced in process (`killed`),
    or left alone, the run the recovered world is held to (issue 62 point 8: at least 0.9x); and each rank's median
    busy ms a step there (its step less its wait for the all-reduce: which rank holds the others back)."""
    last = AFTER_FROM + window
    with submitted(enroot, folder, sqsh, "after", "DDPACK_STANDBYS=1") as (job, metrics, log):
        wait_for_progress(metrics, 30, log, "the job did not train", timeout=300)
        warm(job, log, 1)
        if killed:
            kill_task(job, log, 1)
        deadline = time.monotonic() + 600
        while not any(r["kind"] == "progress" and r["global_step"] >= last for r in read_metrics(metrics)):
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_restart: job {job} did not reach step {last}; its log and run kept in {kept(log)}")
            time.sleep(0.5)
        records = read_metrics(metrics)
    if killed and not any(r["kind"] == "recovery" for r in records):
        raise SystemExit(f"bench_restart: job {job} did not recover in process; its log and run kept in {kept(log)}")
    window_records = [r for r in records if r["kind"] == "progress" and AFTER_FROM < r["global_step"] <= last]
    steps = [r["global_step"] for r in window_records]
    if sorted(steps) != list(range(AFTER_FROM + 1, last + 1)):
        raise SystemExit(
            f"bench_restart: job {job} logged steps {AFTER_FROM + 1}-{last} not once each; its log and run kept in {kept(log)}"
        )
    busy = [statistics.median(1e3 * (r["rank_step_s"][rank] - r["rank_sync_s"][rank]) for r in window_records) for rank in range(4)]
    return statistics.median(r["samples_per_s"] for r in window_records), busy


def after_main(rounds: int, sqsh: Path | None, window: int) -> int:
    """A B A B: an uninterrupted run with a standby, then the same run with rank 1 killed and replaced in process; the
    median samples/s over the same `window` steps after the recovery, and their ratio (goal: at least 0.9x)."""
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-restart-", dir="/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        enroot = enroot_at("HEAD", work / "enroot")
        rates: dict[str, list[float]] = {"uninterrupted": [], "recovered": []}
        for round_ in range(rounds):
            for side in rates:
                rate, busy = one_after(enroot, work / f"{side}-{round_}", sqsh, side == "recovered", window)
                rates[side].append(rate)
                ranks = " ".join(f"{ms:.2f}" for ms in busy)
                print(f"round {round_ + 1} {side:<13} {rate:,.0f} samples/s; busy ms a step, ranks 0-3: {ranks}", flush=True)
    path = f"pyxis-per-task.sbatch, {sqsh.name}" if sqsh else "baremetal.sbatch"
    base, now = statistics.median(rates["uninterrupted"]), statistics.median(rates["recovered"])
    ratios = ", ".join(f"{r / u:.2f}" for u, r in zip(rates["uninterrupted"], rates["recovered"], strict=True))
    print(
        f"\nafter a recovery on the test cluster ({path}, 2 nodes x 2 ranks and a standby; {rounds} rounds, A B A B; medians): "
        f"steps {AFTER_FROM + 1}-{AFTER_FROM + window} at {now:,.0f} samples/s with rank 1 replaced in process against {base:,.0f} "
        f"uninterrupted: {now / base:.2f}x (goal >= 0.9; rounds {ratios})"
    )
    return 0


@contextlib.contextmanager
def resumed(node: str | None) -> Iterator[None]:
    """`node` (when one is named) set back up once the job is gone, if Slurm has not, and waited for until sinfo calls it
    idle: the next round's job must find every node up, or its placement differs (no spare, so no standby there)."""
    try:
        yield
    finally:
        if node is not None:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.split()
                if states and all(state == "idle" for state in states):
                    break
                time.sleep(0.5)


def standbys_main(rounds: int, sqsh: Path | None, rank: int, second: bool, node_down: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-restart-", dir="/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        enroot = enroot_at("HEAD", work / "enroot")
        rows: dict[str, list[dict[str, float]]] = {"restart": [], "in-process": []}
        for round_ in range(rounds):
            for side, standbys in (("restart", 0), ("in-process", 1)):
                row = one_kill(enroot, work / f"{side}-{round_}", sqsh, standbys, rank, second and standbys > 0, node_down)
                rows[side].append(row)
                print(f"round {round_ + 1} {side:<10} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    path = f"pyxis-per-task.sbatch, {sqsh.name}" if sqsh else "baremetal.sbatch"
    medians = {side: {k: statistics.median(r[k] for r in found) for k in found[0]} for side, found in rows.items()}
    what = f"rank {rank} killed" + (", then rank 2 (in-process: the second death's row)" if second else "")
    if node_down:
        what = "ddnode2 set DOWN and its tasks killed, 1 spare (restart: the spare swap; in-process: the spare's 2 standbys)"
    print(f"\n{what} on the test cluster ({path}, 2 nodes x 2 ranks; {rounds} rounds, A B A B; medians; seconds after the SIGKILL)")
    for side, found in medians.items():
        print(f"{side:<11} " + "  ".join(f"{k} {v:.3f}" for k, v in found.items()))
    now, before = medians["in-process"], medians["restart"]
    print(f"in-process/restart: back {now['back'] / before['back']:.2f}x, past the interrupted step {now['past'] / before['past']:.2f}x")
    print(json.dumps({"medians": medians}))
    return 0


def import_torch_s(python: str, rounds: int = 3) -> float:
    """A step of the same shape (srun, 2 nodes, 4 tasks) whose tasks only start Python and `import torch`, the median of
    `rounds`: the floor of a trainer's start here (the test nodes share this host's cores)."""
    times = []
    for _ in range(rounds):
        started = time.monotonic()
        subprocess.run(["srun", "--nodes=2", "--ntasks=4", python, "-c", "import torch"], check=True, capture_output=True)
        times.append(time.monotonic() - started)
    return statistics.median(times)


LOCAL_ARGS = [
    "--dataset-size",
    "65536",
    "--epochs",
    "1",
    "--log-every",
    "1",
    "--snapshot-every",
    "10",
    "--hang-timeout",
    "0",
    "--cpu-bind",
    "none",
]
LOCAL_KILL_AT = 45  # steps: 5 past the snapshot at 40, as a failure lands on average halfway between snapshots of 10


def start_ranks(folder: Path, args: list[str], port: int, world: int = 4, standbys: int = 0) -> list[subprocess.Popen[bytes]]:
    """`world` ranks of `python -m train` with RANK/WORLD_SIZE/MASTER_* each (and `standbys` with --standby)."""
    procs = []
    for index in range(world + standbys):
        rank_env = {
            "RANK": str(index if index < world else 0),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with open(folder / f"task{index}.log", "ab") as out:
            argv = [sys.executable, "-m", "train", *args, *(["--standby"] if index >= world else [])]
            procs.append(subprocess.Popen(argv, env=env(OMP_NUM_THREADS="1", **rank_env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
    return procs


def kill_when_past(procs: list[subprocess.Popen[bytes]], metrics: Path, step: int, rank: int = 3) -> tuple[float, int]:
    """SIGKILL `rank` once rank 0 logged `step`: (the wall clock of the kill, the newest step logged before it)."""
    deadline = time.monotonic() + 300
    while (logged := max((r.get("global_step", 0) for r in read_metrics(metrics) if r["kind"] == "progress"), default=0)) < step:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_restart: the run did not reach step {step}; see {metrics.parent}")
        time.sleep(0.01)
    killed_at = time.time()
    procs[rank].send_signal(signal.SIGKILL)
    return killed_at, logged


def local_restart(folder: Path) -> dict[str, float]:
    """Today's path, once (see the module's docstring)."""
    from train.distributed import free_port

    metrics = folder / "metrics.jsonl"
    args = [*LOCAL_ARGS, "--snapshot-dir", str(folder / "snap"), "--metrics-file", str(metrics)]
    procs = start_ranks(folder, args, free_port())
    killed_at, logged = kill_when_past(procs, metrics, LOCAL_KILL_AT)
    for proc in procs:  # srun ends the step's other tasks when one fails; the job program then starts a new step
        proc.kill()
        proc.wait()
    again = start_ranks(folder, args, free_port())
    try:
        deadline = time.monotonic() + 300
        while not (
            past := [r for r in read_metrics(metrics) if r["kind"] == "progress" and r["time"] > killed_at and r["global_step"] > logged]
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_restart: the restarted run did not train past step {logged}; see {folder}")
            time.sleep(0.01)
        records = [r for r in read_metrics(metrics) if r["time"] > killed_at]
    finally:
        for proc in again:
            proc.kill()
            proc.wait()
    start = next(r for r in records if r["kind"] == "start")
    back = next(r for r in records if r["kind"] == "progress")
    return {
        "start": start["time"] - killed_at,
        "back": back["time"] - killed_at,
        "past": past[0]["time"] - killed_at,
        "replayed": logged - start["global_step"],
    }


def local_inprocess(folder: Path) -> dict[str, float]:
    """In-process recovery, once (see the module's docstring)."""
    from train.distributed import free_port

    metrics = folder / "metrics.jsonl"
    args = [*LOCAL_ARGS, "--snapshot-dir", "", "--metrics-file", str(metrics), "--recovery"]
    procs = start_ranks(folder, args, free_port(), standbys=1)
    try:
        killed_at, _ = kill_when_past(procs, metrics, LOCAL_KILL_AT)
        deadline = time.monotonic() + 60
        while True:  # the recovery record, then the redone step's progress record
            records = read_metrics(metrics)
            found = [r for r in records if r["kind"] == "recovery"]
            after = [r for r in records if found and r["kind"] == "progress" and r["time"] > found[0]["failed_at"]]
            if after:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_restart: no recovery record and step after it within 60 s; see {folder}")
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    record, back = found[0], after[0]
    stages = {
        "notice": record["failed_at"] - killed_at,
        **{k[:-2]: record[k] for k in ("decide_s", "abort_s", "new_group_s", "state_s", "first_step_s")},
    }
    return {**stages, "back": back["time"] - killed_at, "past": back["time"] - killed_at, "replayed": 0}


def local_main(rounds: int) -> int:
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-restart-", dir="/tmp") as tmp:
        rows: dict[str, list[dict[str, float]]] = {"restart": [], "in-process": []}
        for round_ in range(rounds):
            for side, run in (("restart", local_restart), ("in-process", local_inprocess)):
                folder = Path(tmp) / f"{side}-{round_}"
                folder.mkdir()
                row = run(folder)
                rows[side].append(row)
                print(f"round {round_ + 1} {side:<10} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    medians = {side: {k: statistics.median(r[k] for r in found) for k in found[0]} for side, found in rows.items()}
    print(f"\na killed rank on this host (4 ranks, per-task shape, gloo; {rounds} rounds, A B A B; medians; seconds after the SIGKILL)")
    for side, found in medians.items():
        print(f"{side:<11} " + "  ".join(f"{k} {v:.3f}" for k, v in found.items()))
    now, before = medians["in-process"], medians["restart"]
    print(
        f"in-process/restart: back {now['back'] / before['back']:.2f}x, past the interrupted step {now['past'] / before['past']:.2f}x; "
        f"in-process's {now['back']:.2f} s: notice {now['notice']:.2f} (the collective timeout), decide {now['decide']:.2f}, "
        f"abort {now['abort']:.3f}, new group {now['new_group']:.3f}, state {now['state']:.3f}, first step {now['first_step']:.3f}"
    )
    print(json.dumps({"medians": medians}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="fa34be6", help="the revision whose job program is side A")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sqsh", type=lambda path: Path(path).resolve(),
                        help="an image (make sqsh; relative to here): the pyxis path, pyxis-per-task.sbatch, instead of bare metal")  # fmt: skip
    parser.add_argument(
        "--local", action="store_true", help="on this host, no Slurm: today's restart against in-process recovery (issue 56)"
    )
    parser.add_argument(
        "--standbys", action="store_true", help="on the test cluster, this revision: today's restart against DDPACK_STANDBYS=1"
    )
    parser.add_argument("--kill-rank", type=int, default=3, help="with --standbys: the rank SIGKILLed (0: the store task's case)")
    parser.add_argument(
        "--second-death", action="store_true", help="with --standbys: in-process, rank 2 killed too once a new standby is warm"
    )
    parser.add_argument("--node-down", action="store_true", help="with --standbys: ddnode2 set DOWN and its tasks killed, with a spare")
    parser.add_argument("--after", type=int, metavar="STEPS",
                        help="with --standbys: samples/s over STEPS steps after rank 1's recovery in process against an uninterrupted run")  # fmt: skip
    opts = parser.parse_args()
    if (opts.after is not None or opts.node_down) and not opts.standbys:
        parser.error("--after and --node-down compare the paths of --standbys: give it too")
    if opts.after is not None and opts.after < 1:
        parser.error(f"--after {opts.after}: expected a number of steps from 1")
    if opts.local:
        return local_main(opts.rounds)
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print(
            "bench_restart: no Slurm controller answers (sinfo); start the test cluster: .venv/bin/python testbed/slurm_cluster.py",
            file=sys.stderr,
        )
        return 2
    if opts.standbys and opts.after is not None:
        return after_main(opts.rounds, opts.sqsh, opts.after)
    if opts.standbys:
        return standbys_main(opts.rounds, opts.sqsh, opts.kill_rank, opts.second_death, opts.node_down)
    with tempfile.TemporaryDirectory(prefix="ddpack-bench-restart-", dir="/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        sides = {"before": enroot_at(opts.before, work / "before"), "now": enroot_at("HEAD", work / "now")}
        rows: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for round_ in range(opts.rounds):
            for side, enroot in sides.items():
                row = one_restart(enroot, work / f"{side}-{round_}", opts.sqsh)
                rows[side].append(row)
                print(f"round {round_ + 1} {side:<6} " + "  ".join(f"{k} {v:5.2f} s" for k, v in row.items()), flush=True)
        floor = import_torch_s(str(Path(sys.executable)))
    path = f"pyxis-per-task.sbatch, {opts.sqsh.name}" if opts.sqsh else "baremetal.sbatch"
    print(f"\na killed rank trained again in place ({path}; {opts.rounds} rounds, A B A B; medians; seconds after the SIGKILL)")
    print(f"{'':<8} {'detect':>7} {'decided':>8} {'started':>8} {'back':>7}")
    medians = {side: {k: statistics.median(r[k] for r in found) for k in found[0]} for side, found in rows.items()}
    for side, found in medians.items():
        print(
            f"{side:<8} "
            + " ".join(f"{found[k]:>7.2f}" if k == "detect" else f"{found[k]:>8.2f}" for k in ("detect", "decided", "started", "back"))
        )
    now, before = medians["now"], medians["before"]
    print(f"now/before: decided {now['decided'] / before['decided']:.2f}x, back {now['back'] / before['back']:.2f}x")
    print(
        f"where now's {now['back']:.1f} s go: {now['detect']:.1f} s to detect, {now['decided'] - now['detect']:.1f} s for the step to end and "
        f"the decision, {now['started'] - now['decided']:.1f} s for the new step and the trainer's start (its floor here: a step of 4 "
        f"tasks that only import torch takes {floor:.1f} s), {now['back'] - now['started']:.1f} s to the first progress record"
    )
    print(json.dumps({"before": opts.before, "medians": medians, "import_torch_s": floor}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
