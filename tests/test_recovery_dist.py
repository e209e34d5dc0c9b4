"""In-process recovery with real processes on this machine (gloo): a rank killed with SIGKILL is replaced by a
warm standby that takes a survivor's state, and the run ends bit for bit as an uninterrupted one; without a
standby the survivors fall back to today's restart and say why. No snapshots are written: the state can only
come from a survivor."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from ddp_jobs import ENTRYPOINT, Job, metrics_step, subdir, wait_for

from testbed.env import ROOT, clean_env
from train.distributed import free_port

pytestmark = pytest.mark.dist

# 2048 samples (90% for training) / (2 ranks x 32) = 28 steps; no snapshot: a replacement's state is a survivor's.
# The ranks bind to their CPU slices (--cpu-bind auto, the default): a standby that takes a place joins past that collective.
ARGS = ["--dataset-size", "2048", "--epochs", "1", "--batch-size", "32", "--log-every", "1", "--snapshot-dir", "", "--recovery"]


def start_with_standbys(tmp: Path, world: int, args: Sequence[str], standbys: int, **extra: str) -> Job:
    """`world` ranks and `standbys` standbys in the per-task shape, as a template's step starts them (DDPACK_STANDBYS):
    world + standbys processes of one command, each with its launcher RANK of WORLD_SIZE=world + standbys (srun tasks'
    SLURM_PROCID, `docker run -e`) and `--standbys`; the last ones, procs[world:], are the standbys."""
    port = str(free_port())
    procs, logs = [], []
    for index in range(world + standbys):
        logs.append(tmp / (f"standby{index - world}.log" if index >= world else f"rank{index}.log"))
        env = clean_env(RANK=str(index), WORLD_SIZE=str(world + standbys), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        argv = [*ENTRYPOINT, *args, "--standbys", str(standbys)]
        with open(logs[-1], "wb") as out:
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp))
    return Job(procs, logs)


def progress_steps(metrics: Path) -> list[int]:
    return [json.loads(line)["global_step"] for line in metrics.read_text().splitlines() if '"progress"' in line]


def test_a_killed_rank_is_replaced_by_the_standby_with_a_survivors_state_and_the_run_ends_bit_exact(tmp_path: Path) -> None:
    reference = subdir(tmp_path, "reference")
    whole = start_with_standbys(reference, 2, [*ARGS, "--metrics-file", str(reference / "m.jsonl")], standbys=1)
    assert whole.wait() == [0, 0, 0], whole.output()  # the standby the run did not need leaves with 0
    expected = set(whole.checksums())
    assert len(expected) == 1 and "took rank" not in whole.output(), whole.output()

    killed = subdir(tmp_path, "killed")
    metrics = killed / "m.jsonl"
    job = start_with_standbys(killed, 2, [*ARGS, "--metrics-file", str(metrics)], standbys=1)
    wait_for(lambda: metrics_step(metrics) >= 10, 120, "step 10")
    job.send(signal.SIGKILL, [1])
    codes = job.wait()
    assert codes[0] == 0 and codes[2] == 0 and codes[1] == -signal.SIGKILL, job.output()
    assert "[rank 1/2] standby took rank 1: state of rank 0 at epoch 1/1 step" in job.output(2)
    assert "recovery: rank 1 lost in generation 0" in job.output(0) and "s0 takes rank 1" in job.output(0)
    # The same parameters as the uninterrupted run, on the survivor and on the standby that took rank 1.
    assert [end.checksum for end in job.ends(0)] == [*expected] and [end.checksum for end in job.ends(2)] == [*expected]
    steps = progress_steps(metrics)
    assert len(steps) == len(set(steps)) and steps == sorted(steps), steps  # no global step trained twice
    assert steps[-1] == job.ends(0)[-1].total_steps
    record = next(r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "recovery")
    assert record["generation"] == 1 and record["global_step"] > 10  # the first step trained after the recovery
    assert {"decide_s", "abort_s", "new_group_s", "state_s", "first_step_s", "total_s"} <= record.keys()


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
    args = ["--task", "plugins.slow_rank:task", "--max-steps", "7", "--log-every", "1", "--snapshot-dir", "", "--recovery", "--cpu-bind", "none"]
    job = start_with_standbys(tmp_path, 2, args, standbys=0, SLOW_RANK="1", SLOW_RANK_MS="2200", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    assert job.wait() == [0, 0], job.output()
    assert "recovery:" not in job.output() and len(set(job.checksums())) == 1, job.output()
