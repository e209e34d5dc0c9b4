"""The cluster tests' gate (testbed/held_task.py) on its own, in one trainer process: it holds the run at the step
asked, says so, tells a stop signal that reaches it while held, and lets the run go on, and stop at the next step,
once the test opens it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from testbed.env import clean_env
from testbed.slurm_jobs import HELD_LINE, HELD_TRAIN_ARGS, SIGNALLED_LINE, Gate, hold_training


def test_the_run_is_held_until_the_gate_opens_then_stops_on_the_signal_it_got_while_held(tmp_path: Path) -> None:
    gate = hold_training(tmp_path / "submission", at=5)
    assert gate.train_args == HELD_TRAIN_ARGS
    log = tmp_path / "job.out"
    args = [*gate.train_args.split(), "--dataset-size", "2048", "--epochs", "50", "--log-every", "1"]
    with log.open("w") as out:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "train", *args, "--snapshot-dir", str(tmp_path / "snapshots")],
            cwd=gate.folder, env=clean_env(**gate.settings, DDPACK_PROJECT_DIR=str(gate.folder)), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            key = gate.held(log, world=1, timeout=120)
            assert key == "0.0" and "global 5/" in log.read_text() and "global 6/" not in log.read_text()
            time.sleep(1)  # held is held: no step goes past the gate
            assert "global 6/" not in log.read_text() and trainer.poll() is None
            trainer.send_signal(signal.SIGUSR1)
            gate.signalled(log, key, world=1)
            gate.open(key)
            assert trainer.wait(timeout=120) == 138
        finally:
            trainer.kill()
    text = log.read_text()
    assert HELD_LINE.findall(text) == [("0", "0.0")] and SIGNALLED_LINE.findall(text) == [("0", "SIGUSR1", "0.0")]
    steps = [int(n) for n in re.findall(r"global (\d+)/", text)]
    assert max(steps) == 6 and "stopped on SIGUSR1" in text, text[-2000:]


def test_an_open_gate_holds_no_start(tmp_path: Path) -> None:
    gate = Gate(tmp_path, {}, "")
    gate.open()
    assert (tmp_path / "gate").stat().st_mode & 0o777 == 0o644


def test_a_gate_never_opened_gives_up_after_hold_max_s_and_the_run_ends_by_itself(tmp_path: Path) -> None:
    """A test that failed before opening its gate leaves no job holding its nodes for ever."""
    gate = hold_training(tmp_path / "submission", at=2, train_args="--dataset-size 512 --epochs 1 --log-every 1")
    out = subprocess.run(
        [sys.executable, "-m", "train", *gate.train_args.split(), "--snapshot-dir", str(tmp_path / "snapshots")],
        cwd=gate.folder, env=clean_env(**gate.settings, HOLD_MAX_S="1", DDPACK_PROJECT_DIR=str(gate.folder)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "held_task: rank 0 gave up waiting after 1 s (HOLD_MAX_S); training on" in out.stdout
    assert "checksums agree across 1 ranks" in out.stdout


def test_every_ranks_line_is_found_when_two_ran_together_or_srun_labelled_them(tmp_path: Path) -> None:
    """Seen under torchrun: two workers' lines ran into one (print wrote each line and its newline apart); under the
    per-task template srun labels a program's lines with their rank."""
    held = "held_task: rank {r} held at batch 20 of start 0.1 until /fsx/gate-0.1 exists"
    log = tmp_path / "job.out"
    log.write_text(held.format(r=3) + held.format(r=2) + "\n" + f" 1: {held.format(r=1)}\n" + f"10: {held.format(r=0)}\n")
    gate = Gate(tmp_path, {}, "")
    assert gate.held(log, 4, timeout=1) == "0.1"
    log.write_text(log.read_text() + "".join(f"{r}: held_task: rank {r} got SIGUSR1 while held in start 0.1\n" for r in range(4)))
    gate.signalled(log, "0.1", 4, timeout=1)
