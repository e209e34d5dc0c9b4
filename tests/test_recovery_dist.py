"""In-process recovery with real processes on this machine (gloo): a rank killed with SIGKILL is replaced by a
warm standby that takes a survivor's state, and the run ends bit for bit as an uninterrupted one, after another user
spent two seconds writing forged, malformed and deleted keys into its store; without a standby the survivors fall
back to today's restart and say why. No snapshots are written: the state can only come from a survivor."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from ddp_jobs import ENTRYPOINT, Job, metrics_step, subdir, wait_for
from store_attacker import run_as_another_user

from testbed.env import ROOT, clean_env
from train.distributed import free_port

pytestmark = pytest.mark.dist

# 2048 samples (90% for training) / (2 ranks x 32) = 28 steps; no snapshot: a replacement's state is a survivor's.
# The killed run's job has a token (DDPACK_JOB_TOKEN, as the templates set it) and 8192 samples (115 steps): room for
# the attack, the steps after it and the death.
# The ranks bind to their CPU slices (--cpu-bind auto, the default): a standby that takes a place joins past that collective.
ARGS = ["--dataset-size", "2048", "--epochs", "1", "--batch-size", "32", "--log-every", "1", "--snapshot-dir", "", "--recovery"]


def start_with_standbys(tmp: Path, world: int, args: Sequence[str], standbys: int, store_task: bool = False, **extra: str) -> Job:
    """`world` ranks and `standbys` standbys in the per-task shape, as a template's step starts them (DDPACK_STANDBYS):
    world + standbys processes of one command, each with its launcher RANK of WORLD_SIZE=world + standbys (srun tasks'
    SLURM_PROCID, `docker run -e`) and `--standbys`; the last ones, procs[world:], are the standbys. `store_task`: one
    process more, the last, serves the job's store (DDPACK_STORE_TASK=1, as the job program's step sets it)."""
    port = extra.pop("MASTER_PORT", None) or str(free_port())
    procs, logs = [], []
    launched = world + standbys + int(store_task)
    for index in range(launched):
        name = "store" if store_task and index == launched - 1 else f"standby{index - world}" if index >= world else f"rank{index}"
        logs.append(tmp / f"{name}.log")
        env = clean_env(RANK=str(index), WORLD_SIZE=str(launched), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        if store_task:
            env["DDPACK_STORE_TASK"] = "1"
        argv = [*ENTRYPOINT, *args, "--standbys", str(standbys)]
        with open(logs[-1], "wb") as out:
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp))
    return Job(procs, logs)


def progress_steps(metrics: Path) -> list[int]:
    return [json.loads(line)["global_step"] for line in metrics.read_text().splitlines() if '"progress"' in line]


# The attacked run: rank 0 sleeps 40 ms a step (tests/plugins/slow_rank.py), 115 steps, so that the attack (1 s from the
# moment the standby joins) ends with most of the run still to train; a token, as the templates set one.
ATTACKED = [*ARGS, "--dataset-size", "8192", "--task", "plugins.slow_rank:task"]
SLOW = {"SLOW_RANK": "0", "SLOW_RANK_MS": "40", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
TOKEN = "5d41402abc4b2a76b9719d911017c592"

# Another user's program (plain TCPStore calls, nothing of ddpack's): it waits for a standby's registration to appear (it
# starts beside the job), which gives it recovery's prefix, and for `seconds` cycles through what could end, disarm or steer
# the job: a forged decision (a fallback that makes every rank give up; a roster naming its own member), made-up
# signatures, garbage, `closed`, the node's heartbeat and the members' registrations deleted or forged, a failure report
# and the counters. It leaves a forged decision behind, which the real one must replace when the real death comes.
ATTACK = r"""
import json, os, sys, time, datetime
import torch.distributed as dist

port, seconds = int(sys.argv[1]), float(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120), wait_for_workers=False)
while not (found := sorted({k[: k.index("at/s")] for k in store.list_keys() if k.startswith("ddpack-recovery/") and "/at/s" in k})):
    time.sleep(0.01)  # until a standby has joined: the ranks are training by then
p = found[0]
keys = store.list_keys()
nodes = [k for k in keys if k.startswith(p + "hb/")] or [p + "hb/0123456789abcdef"]
give_up = json.dumps({"generation": 1, "roster": {"0": "r0", "1": "r1"}, "dead": {}, "replacements": {}, "fallback": "forged"})
mine = json.dumps({"generation": 1, "roster": {"0": "r0", "1": "s9"}, "dead": {"1": "r1"}, "replacements": {"1": "s9"}, "fallback": None})
moves = [
    lambda: store.set(p + "gen0/decision", give_up),
    lambda: store.set(p + "gen0/decision", "0" * 64 + " " + mine),
    lambda: store.set(p + "gen0/decision", "[" * 100000),
    lambda: store.set(p + "gen0/decision", b"\xff\xfe"),
    lambda: store.set(p + "closed", "1"),
    lambda: [store.delete_key(k) for k in nodes],
    lambda: store.delete_key(p + "at/r1"),
    lambda: store.delete_key(p + "at/s0"),
    lambda: store.add(p + "gen0/failed", 1),
    lambda: store.set(p + "gen0/failed/r0", "1"),
    lambda: store.add(p + "standbys", 3),
    lambda: store.set(nodes[0], "ddmallory-box 99999999999 0 r1:99999999:0 s9:1:0"),
    lambda: store.set(p + "at/s9", "0123456789abcdef"),
]
until = time.monotonic() + seconds
while time.monotonic() < until:
    for move in moves:
        move()
        time.sleep(0.01)
store.set(p + "gen0/decision", give_up)
print(os.getuid(), len(keys), flush=True)
"""


def test_a_killed_rank_is_replaced_by_the_standby_with_a_survivors_state_and_the_run_ends_bit_exact(tmp_path: Path) -> None:
    """The step's shape on the cluster: 2 ranks, the launcher's standby and the store task (DDPACK_STORE_TASK=1), which
    serves the job's store, so rank 0 is a client like any rank. Another user writes into the store for a second; then
    rank 0 is SIGKILLed: the standby takes its place and its duties (it writes the run's metrics from then on), and the
    store task starts a new standby for the one consumed; the standby in rank 0's place SIGKILLed in turn is replaced
    by that one. Rank 1 sleeps 100 ms a step (128 steps: room for the attack and two standbys' warm-up)."""
    slow = {**SLOW, "SLOW_RANK": "1", "SLOW_RANK_MS": "100"}
    # The same run with no sleep and no standby, beside the attacked job (its own port and store): the test's time is one run's.
    reference = subdir(tmp_path, "reference")
    whole = start_with_standbys(
        reference, 2, [*ATTACKED, "--metrics-file", str(reference / "m.jsonl")], standbys=0, PYTHONPATH=SLOW["PYTHONPATH"]
    )

    killed = subdir(tmp_path, "killed")
    metrics = killed / "m.jsonl"
    port = free_port()
    mallory, uid = run_as_another_user(ATTACK, port, 1.0)
    job = start_with_standbys(
        killed,
        2,
        [*ATTACKED, "--metrics-file", str(metrics)],
        standbys=1,
        store_task=True,
        MASTER_PORT=str(port),
        DDPACK_JOB_TOKEN=TOKEN,
        **slow,
    )
    out, _ = mallory.communicate(timeout=120)
    assert mallory.returncode == 0 and int(out.split()[0]) == uid
    after_attack = metrics_step(metrics)
    wait_for(lambda: metrics_step(metrics) >= max(after_attack + 5, 10), 60, "5 steps after the attack")
    assert [p.poll() for p in job.procs] == [None] * 4, job.output()  # nobody gave up, the standby and the store stayed
    ignored = [line for line in job.output().splitlines() if "recovery: ignored the store's" in line]
    assert any("gen0/decision" in line for line in ignored) and any("closed" in line for line in ignored), job.output()
    store = lambda: job.output(3)  # noqa: E731 - the store task's lines, and the new standby's (started by it, its output beside)
    wait_for(lambda: "store task: new standbys fork warm from pid" in store(), 60, "the store task's forker warm")
    job.send(signal.SIGKILL, [0])  # and then a real death, of rank 0, recovered in process all the same
    wait_for(lambda: re.search(r"standby s[0-9]+ on \S+: warm, watching", store()) is not None, 120, "the store task's new standby warm")
    # and the first recovery's record written, by the standby in rank 0's place once the redone step ended: forked
    # warm, the new standby can be watching before that step ends, and a death in it leaves generation 1 no record
    wait_for(lambda: "recovery: trained global step" in job.output(2), 60, "generation 1's record")
    assert metrics_step(metrics) < 110, "the run is almost over before the second death"
    job.send(signal.SIGKILL, [2])  # the standby in rank 0's place
    codes = job.wait()
    assert whole.wait() == [0, 0], whole.output()
    expected = set(whole.checksums())
    assert len(expected) == 1, whole.output()
    assert codes == [-signal.SIGKILL, 0, -signal.SIGKILL, 0], job.output()
    assert "serving the job's store at 127.0.0.1:" in store() and "the run ended; the store closes" in store(), store()
    assert re.search(r"store task: a standby took a place in generation 1; started a new one \(pid \d+\)$", store(), re.M), store()
    # the standbys' names are their indexes; the store task's is past the counter the attacker bumped: s<n>
    assert re.search(r"recovery: rank 0 lost in generation 0 \(\w+\); s0 takes rank 0", job.output(1)), job.output(1)
    assert re.search(r"recovery: rank 0 lost in generation 1 \(\w+\); s[0-9]+ takes rank 0", job.output(1)), job.output(1)
    assert "[rank 0/2] standby took rank 0: state of rank 1 at epoch 1/1 step" in job.output(2), job.output(2)
    assert "[rank 0/2] standby took rank 0: state of rank 1 at epoch 1/1 step" in store(), store()
    # The same parameters as the uninterrupted run, on the survivor and on the second standby in rank 0's place.
    assert [end.checksum for end in job.ends(1)] == [*expected] and [end.checksum for end in job.ends(3)] == [*expected]
    steps = progress_steps(metrics)  # rank 0's records: the killed one's, then each standby's in its place
    assert len(steps) == len(set(steps)) and steps == sorted(steps), steps  # no global step trained twice
    assert steps[-1] == job.ends(3)[-1].total_steps
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
    assert [r["kind"] for r in records].count("start") == 1 and records[-1]["kind"] == "end" and records[-1]["outcome"] == "done"
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert [r["generation"] for r in recoveries] == [1, 2] and recoveries[0]["global_step"] > 10, recoveries
    assert {"decide_s", "abort_s", "new_group_s", "state_s", "first_step_s", "total_s"} <= recoveries[0].keys()


def test_without_a_standby_the_survivor_falls_back_to_a_restart_and_says_why(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    job = start_with_standbys(tmp_path, 2, [*ARGS, "--metrics-file", str(metrics)], standbys=0)
    wait_for(lambda: metrics_step(metrics) >= 5, 120, "step 5")
    job.send(signal.SIGKILL, [1])
    assert job.procs[0].wait(timeout=60) == 1, job.output()
    out = job.output(0)
    assert "recovery: falling back to a restart of every rank: a collective failed" in out and "no standby is running" in out
    end = job.ends(0)[-1]
    assert end.outcome == "failed" and end.exit_code == 1 and end.reason.startswith("in-process recovery impossible: ")


def test_a_slow_but_healthy_collective_is_not_taken_for_a_death(tmp_path: Path) -> None:
    """Rank 1 takes 2.2 s a step (tests/plugins/slow_rank.py), so rank 0 waits that long in every all-reduce: above the
    timeout's floor (2 s), below the timeout the measured steps set (train.recovery.collective_timeout), which steps 6
    and 7 run under."""
    args = [
        "--task",
        "plugins.slow_rank:task",
        "--max-steps",
        "7",
        "--log-every",
        "1",
        "--snapshot-dir",
        "",
        "--recovery",
        "--cpu-bind",
        "none",
    ]
    job = start_with_standbys(tmp_path, 2, args, standbys=0, SLOW_RANK="1", SLOW_RANK_MS="2200", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    assert job.wait() == [0, 0], job.output()
    assert "recovery:" not in job.output() and len(set(job.checksums())) == 1, job.output()


def test_a_frozen_rank_is_replaced_from_its_stopped_heartbeat_before_the_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 is SIGSTOPped (a frozen driver, or a node lost without a connection reset: nothing fails, the survivor's
    collective just waits). Every step takes 400 ms (rank 0 sleeps, plugins/slow_rank.py), so the measured collective
    timeout is 8 s: the survivor leaves its wait on the standbys' decision (PeerDeclaredDead) made from rank 1's
    heartbeat stopped for FROZEN_S while rank 0 waits, not on that timeout (RuntimeError). Continued, rank 1 learns it
    was counted dead and ends alone (cause counted-dead) without sending the standby away."""
    metrics = tmp_path / "m.jsonl"
    snapshots = ["--snapshot-dir", str(tmp_path / "snapshots"), "--snapshot-every", "3"]  # during and after the recovery
    args = [
        *ARGS,
        "--task",
        "plugins.slow_rank:task",
        "--max-steps",
        "16",
        "--metrics-file",
        str(metrics),
        "--cpu-bind",
        "none",
        *snapshots,
    ]
    slow = {"SLOW_RANK": "0", "SLOW_RANK_MS": "400", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    job = start_with_standbys(tmp_path, 2, args, standbys=1, DDPACK_JOB_TOKEN=TOKEN, **slow)  # signed, as every templated job
    wait_for(lambda: metrics_step(metrics) >= 8 and "warm, watching" in job.output(2), 120, "step 8, the timeout tightened")
    job.send(signal.SIGSTOP, [1])
    wait_for(lambda: "recovery: rank 1 lost in generation 0" in job.output(0), 60, "the recovery")
    job.send(signal.SIGCONT, [1])
    assert job.wait() == [0, 1, 0], job.output()
    assert "recovery: rank 1 lost in generation 0 (PeerDeclaredDead)" in job.output(0), job.output(0)
    assert "heartbeat of rank 1 stopped for 1.5s while a survivor waits on a collective" in job.output(2), job.output(2)
    frozen = job.ends(1)[-1]
    assert frozen.cause == "counted-dead" and "was counted dead by the standbys" in (frozen.reason or ""), frozen
    assert len(set(job.checksums())) == 1 and job.ends(0)[-1].global_step == 16
    steps = progress_steps(metrics)
    assert len(steps) == len(set(steps)), steps  # no global step trained twice
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    recovered_at = next(r["global_step"] for r in records if r["kind"] == "recovery")
    written = [r["global_step"] for r in records if r["kind"] == "snapshot"]
    assert any(step < recovered_at for step in written) and 16 in written, written


def test_a_live_rank_held_2s_is_not_taken_for_frozen_and_a_death_in_a_progress_line_loses_no_line(tmp_path: Path) -> None:
    """Rank 1 holds the interpreter's lock for 2.5 s in one forward (plugins/slow_rank.py: a C call that keeps it), once
    the standby watches and the timeout is tightened (8 s: rank 0 sleeps 400 ms a step): its heartbeat thread cannot
    run, rank 0 waits on the all-reduce, and rank 1's beat is late past FROZEN_S. Its node says its process runs, so
    no standby decides (seen on the test cluster before the node said so: a live rank 1.5 s late on a saturated node
    counted dead and replaced). Then rank 1 dies entering a progress line's all-reduce (DDPACK_TEST_DIE_IN_PROGRESS,
    tests only): the standby takes its place, and the line the death interrupted, of the step the state was taken at,
    is written after the recovery: one progress record for every global step, none twice."""
    metrics, hold, die = tmp_path / "m.jsonl", tmp_path / "hold", tmp_path / "die"
    args = [*ARGS, "--task", "plugins.slow_rank:task", "--max-steps", "18", "--metrics-file", str(metrics), "--cpu-bind", "none"]
    env = {"SLOW_RANK": "0", "SLOW_RANK_MS": "400", "HOLD_GIL_RANK": "1", "HOLD_GIL_FILE": str(hold), "HOLD_GIL_MS": "2500"}
    job = start_with_standbys(
        tmp_path, 2, args, standbys=1, DDPACK_JOB_TOKEN=TOKEN, DDPACK_TEST_DIE_IN_PROGRESS=f"1:{die}", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", **env
    )
    wait_for(lambda: metrics_step(metrics) >= 8 and "warm, watching" in job.output(2), 120, "step 8, the standby watching")
    hold.touch()
    wait_for(lambda: "held the interpreter's lock" in job.output(1), 60, "rank 1's hold")
    held_at = metrics_step(metrics)
    assert re.search(r"held the interpreter's lock for 2\.[5-9]s", job.output(1)), job.output(1)
    assert "heartbeat of" not in job.output(2) and "recovery:" not in job.output(0), job.output()
    die.touch()
    assert job.wait() == [0, -signal.SIGKILL, 0], job.output()
    assert "stopped for 1.5s" not in job.output(2), job.output(2)  # the death's decision, not the frozen rule's
    assert len({*job.checksums()}) == 1, job.output()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
    recoveries = [r["global_step"] for r in records if r["kind"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0] > held_at, (recoveries, held_at)
    assert progress_steps(metrics) == list(range(1, 19)), progress_steps(metrics)


# Four ranks and a standby on a user's task with BatchNorm, dropout and a DataLoader with a worker, AdamW, two buckets a
# step (--bucket-cap-mb 0.01: plugins/recovery_task.py) and a snapshot every 3 steps: 768 samples / (4 ranks x 8) = 24 steps.
EXACT = [
    *["--task", "plugins.recovery_task:make", "--dataset-size", "768", "--epochs", "1", "--batch-size", "8", "--bucket-cap-mb", "0.01"],
    *["--num-workers", "1", "--optimizer", "adamw", "--log-every", "1", "--snapshot-every", "3", "--keep-snapshots", "9"],
    *["--recovery", "--cpu-bind", "none"],
]


def snapshot_state(path: Path) -> dict:
    """A snapshot's model (parameters and buffers) and optimizer state (AdamW's moments and step counts)."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {"model": saved["model"], "optimizer": saved["optimizer"]["state"]}


def same_tensors(a: object, b: object) -> bool:
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_a_rank_killed_between_two_buckets_of_a_step_costs_no_exactness_at_four_ranks(tmp_path: Path) -> None:
    """Rank 0 SIGKILLs itself in its comm hook at global step 11 once the step's first bucket completed, before the
    second (DDPACK_TEST_DIE_IN_SYNC, tests only; the store task serves the store): every survivor's first bucket is
    summed, its second fails, its optimizer must not run (train/grad_sync.py: confirmed steps), the redone step starts
    from zeroed gradients and from rank 0's BatchNorm statistics as they stood before step 11's forward moved them,
    which died with rank 0 but which every survivor received in that forward's broadcast (train.trainer.buffer_holder).
    The run, and the snapshot at step 12 (the first boundary after the recovery, written by the standby in rank 0's
    place), equal the uninterrupted run's."""
    runs = {}
    for name, standbys, extra in (("reference", 0, {}), ("killed", 1, {"DDPACK_TEST_DIE_IN_SYNC": "0:11"})):
        folder = subdir(tmp_path, name)
        args = [*EXACT, "--metrics-file", str(folder / "m.jsonl"), "--snapshot-dir", str(folder / "snapshots")]
        job = start_with_standbys(folder, 4, args, standbys, store_task=bool(standbys), PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", **extra)
        runs[name] = (folder, job)
    reference, killed = runs["reference"][1], runs["killed"][1]
    assert reference.wait() == [0, 0, 0, 0], reference.output()
    assert killed.wait() == [-signal.SIGKILL, 0, 0, 0, 0, 0], killed.output()
    expected = set(reference.checksums())
    assert len(expected) == 1, reference.output()
    assert re.search(r"recovery: rank 0 lost in generation 0 \(\w+\); s0 takes rank 0", killed.output(1)), killed.output(1)
    assert "standby took rank 0: state of rank 1 at epoch 1/1 step 11/24" in killed.output(4), killed.output(4)
    survivors = [end.checksum for i in (1, 2, 3, 4) for end in killed.ends(i)]
    assert survivors == [*expected] * 4, killed.output()
    metrics = runs["killed"][0] / "m.jsonl"
    steps = progress_steps(metrics)
    assert steps == list(range(1, 25)), steps  # no global step trained twice, none skipped
    record = next(r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "recovery")
    assert record["global_step"] == 12
    for step in (9, 12, 24):  # before, right after the recovery, and at the end
        name = f"snapshots/snapshot-{step:010d}.pt"
        got, want = snapshot_state(runs["killed"][0] / name), snapshot_state(runs["reference"][0] / name)
        assert same_tensors(got, want), f"the snapshot of step {step} differs from the uninterrupted run's"


def test_a_death_inside_a_snapshots_gather_is_recovered_and_every_rank_takes_that_snapshot(tmp_path: Path) -> None:
    """Rank 1 dies entering the step-4 snapshot's gather (DDPACK_TEST_DIE_IN_SNAPSHOT, tests only), once the standby
    watches: the standby takes its place, and the snapshot the death interrupted is taken at once by every rank of the
    new group, the replacement too (taken by the survivors alone, as before, its gather waited on a replacement gone on
    to the next step: on the test cluster the recovered world stuck there, its ranks waiting)."""
    snaps, die = tmp_path / "snaps", tmp_path / "die"
    args = [*ARGS[:-3], "--snapshot-dir", str(snaps), "--snapshot-every", "4", "--keep-snapshots", "9", "--max-steps", "10", "--recovery", "--cpu-bind", "none"]
    args += ["--task", "plugins.slow_rank:task"]
    job = start_with_standbys(tmp_path, 2, args, standbys=1, DDPACK_TEST_DIE_IN_SNAPSHOT=f"1:{die}", **{**SLOW, "SLOW_RANK_MS": "300"})
    wait_for(lambda: "warm, watching" in job.output(2), 120, "the standby watching")
    die.touch()
    assert job.wait() == [0, -signal.SIGKILL, 0], job.output()
    assert len({*job.checksums()}) == 1, job.output()
    taken = re.search(r"snapshot at global step (\d+) was interrupted by the death: taking it now", job.output(0))
    assert taken and (snaps / f"snapshot-{int(taken[1]):010d}.pt").is_file(), job.output(0)


def test_a_replacement_stuck_in_its_first_step_is_a_hang_the_watchdog_ends_with_evidence(tmp_path: Path) -> None:
    """Rank 1 dies entering a progress line's all-reduce once the standby watches (DDPACK_TEST_DIE_IN_PROGRESS); the
    standby (launcher RANK 2) takes its place and then never finishes the redone step: it sleeps in its second training
    forward (the first is the settling step), its heartbeat fresh (tests/plugins/slow_rank.py's STUCK_RANK). A process
    is untimed until its first step ends (it may compile); the replacement, whose module has already run, is timed from
    the state it took, so the watchdog ends the recovered world as hung, naming rank 1. Counted as a first step, it made
    the whole world look busy until the collective timeout (120 s here): rank 0 did not end within this test's wait."""
    forensics, die = tmp_path / "forensics", tmp_path / "die"
    args = [*ARGS[:-1], "--epochs", "20", "--recovery", "--cpu-bind", "none", "--task", "plugins.slow_rank:task"]
    args += ["--hang-timeout", "5", "--collective-timeout", "120", "--forensics-dir", str(forensics)]
    stuck = {"STUCK_RANK": "2", "STUCK_AT_FORWARD": "2"}
    job = start_with_standbys(tmp_path, 2, args, standbys=1, DDPACK_TEST_DIE_IN_PROGRESS=f"1:{die}", **stuck, **{**SLOW, "SLOW_RANK_MS": "100"})
    wait_for(lambda: "warm, watching" in job.output(2), 120, "the standby watching")
    die.touch()
    try:
        codes = [job.procs[0].wait(timeout=100), job.procs[1].wait(timeout=10)]
    finally:
        job.kill()
    assert codes == [124, -signal.SIGKILL], job.output()
    assert "standby took rank 1" in job.output(2) and "stuck at training forward 2" in job.output(2), job.output(2)
    summary = json.loads((forensics / "summary.json").read_text())
    assert summary["behind_ranks"] == [1], summary
