"""Submitting and following Slurm jobs the way a user does, for the Slurm and pyxis tiers."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

VENV = Path(sys.executable).parent.parent
CHECKSUM_RE = re.compile(r"final parameter checksum ([0-9a-f]{16})")


def env(**extra: str) -> dict[str, str]:
    return clean_env(DDPACK_VENV=str(VENV), **extra)


def checksums(text: str) -> set[str]:
    return set(CHECKSUM_RE.findall(text))


def sbatch(template: str, cwd: Path, sbatch_args: tuple[str, ...] = (), **settings: str) -> tuple[int, str]:
    """Submit as a user does (logs folder first), wait for the end, return (exit code, job id)."""
    (cwd / "logs").mkdir(exist_ok=True)
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())])
    out = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--export={exports}", *sbatch_args, str(ROOT / "enroot" / template)],
        env=env(OMP_NUM_THREADS="1"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return out.returncode, out.stdout.strip().split(";")[0]


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def job_state(job: str) -> tuple[str, str, int]:
    """(JobState, Reason, Restarts) from scontrol, which keeps a finished job for MinJobAge seconds."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState", ""), fields.get("Reason", ""), int(fields.get("Restarts", "0"))


def submit_and_preempt(
    tmp_path: Path, name: str, sbatch_args: tuple[str, ...] = (), template: str = "baremetal.sbatch", **settings: str
) -> tuple[str, Path]:
    """Submit a template and signal USR1 mid-run, as `--signal=USR1@90` would; returns (job, log)."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    trainer = [] if "DDPACK_COMMAND" in settings else ["DDPACK_TRAIN_ARGS=--dataset-size 16384 --epochs 2 --log-every 1"]
    exports = ",".join(["ALL", *trainer, *(f"{k}={v}" for k, v in settings.items())])
    job = (
        subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", f"--export={exports}", *sbatch_args, str(ROOT / "enroot" / template)],
            env=env(OMP_NUM_THREADS="1"),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    metrics, log = tmp_path / "runs" / f"{name}-{job}" / "metrics.jsonl", tmp_path / "logs" / f"{name}-{job}.out"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count('"progress"') >= 20):
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    return job, log


def preempt_and_resume(
    tmp_path: Path, name: str, sbatch_args: tuple[str, ...] = (), template: str = "baremetal.sbatch", **settings: str
) -> str:
    """Submit, preempt, let the job requeue and finish; returns the whole appended log."""
    job, log = submit_and_preempt(tmp_path, name, sbatch_args, template, **settings)
    # Slurm itself starts the requeued job once the old credential expires (cred_expire in the test cluster).
    deadline, pending_again, seen = time.monotonic() + 480, False, []
    while True:
        state, reason, restarts = job_state(job)
        if not seen or seen[-1] != (state, reason, restarts):
            seen.append((state, reason, restarts))
        if restarts == 0 and state in FINAL_STATES:
            pytest.fail(f"job {job} ended ({state}) without requeueing:\n{log.read_text()}")
        pending_again = pending_again or (restarts >= 1 and state == "PENDING")
        if pending_again and state in FINAL_STATES:  # the run after the requeue, not the preempted one ending
            break
        assert time.monotonic() < deadline, f"job {job} did not finish: {state}\n{log.read_text() if log.exists() else ''}"
        time.sleep(1)
    text = log.read_text()
    assert "(restart 1)" in text, f"job {job} states {seen}:\n{text}"
    return text
