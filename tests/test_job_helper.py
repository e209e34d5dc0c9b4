"""enroot/ddpack-job.sh, the helper every Slurm template sources, run by bash without a cluster."""

from __future__ import annotations

import subprocess

import pytest
from conftest import ROOT

HELPER = ROOT / "enroot" / "ddpack-job.sh"


def container_path(path: str, mounts: str) -> subprocess.CompletedProcess[str]:
    script = f'. "{HELPER}"; DDPACK_MOUNTS="$2" ddpack_container_path "$1"'
    return subprocess.run(["bash", "-uc", script, "helper", path, mounts], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("path", "mounts", "inside"),
    [
        ("/fsx/team/runs/a-1", "/fsx:/fsx", "/fsx/team/runs/a-1"),
        ("/shared/team/runs/a-1", "/shared/team:/fsx", "/fsx/runs/a-1"),
        ("/shared/team/runs/a-1", "/data:/data,/shared:/mnt/shared:ro,/shared/team:/fsx", "/fsx/runs/a-1"),
        ("/shared/team", "/shared/team/:/fsx/", "/fsx"),
        ("/fsx/x", "/fsx", "/fsx/x"),
    ],
)
def test_run_dirs_are_mapped_through_the_mounts(path: str, mounts: str, inside: str) -> None:
    out = container_path(path, mounts)
    assert out.returncode == 0 and out.stdout == inside + "\n", out.stderr


def test_a_run_dir_outside_every_mount_is_one_line() -> None:
    out = container_path("/home/me/runs/a-1", "/fsx:/fsx,/fsxdata:/data")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "ddpack: error: /home/me/runs/a-1 is not under any of DDPACK_MOUNTS=/fsx:/fsx,/fsxdata:/data (host:container pairs), "
        "so the container cannot reach it; submit from a folder on a mounted filesystem or add its mount to DDPACK_MOUNTS\n"
    )


@pytest.mark.parametrize(("help_text", "code"), [("  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH", 0), ("  --cpu-bind=...", 2)])
def test_pyxis_is_required_before_anything_runs(tmp_path, help_text: str, code: int) -> None:
    fake = tmp_path / "srun"
    fake.write_text(f"#!/bin/sh\necho 'Usage: srun [OPTIONS(0)...]'\necho '{help_text}'\n")
    fake.chmod(0o755)
    script = f'PATH="{tmp_path}:$PATH"; . "{HELPER}"; ddpack_require_pyxis; echo still-here'
    out = subprocess.run(["bash", "-uc", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == code, out.stderr
    assert (out.stdout == "still-here\n") == (code == 0)
    assert ("pyxis is not loaded" in out.stderr) == (code == 2)


def step_command(**settings: str) -> subprocess.CompletedProcess[str]:
    script = f'. "{HELPER}"; ddpack_command /fsx/runs/a-1; printf "<%s>" "${{ddpack_cmd[@]}}"; echo; echo "$DDPACK_SNAPSHOT_DIR $DDPACK_METRICS_FILE"'
    env = {"PATH": "/usr/bin:/bin", **settings}
    return subprocess.run(["bash", "-uc", script], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({}, "<>"),  # the image's own command (APP_CMD), else the bundled trainer
        ({"DDPACK_TRAIN_ARGS": "--task mytask:make --epochs 50"}, "<--task><mytask:make><--epochs><50>"),
        ({"DDPACK_COMMAND": "python ddp.py 50 5"}, "<--><python><ddp.py><50><5>"),
    ],
)
def test_the_training_step_runs_your_command_the_trainers_flags_or_the_images_own(settings: dict[str, str], words: str) -> None:
    out = step_command(**settings)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{words}\n/fsx/runs/a-1/snapshots /fsx/runs/a-1/metrics.jsonl\n"


def test_a_command_and_trainer_flags_together_are_one_line() -> None:
    out = step_command(DDPACK_COMMAND="python ddp.py", DDPACK_TRAIN_ARGS="--epochs 3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("ddpack: error: DDPACK_COMMAND and DDPACK_TRAIN_ARGS are both set;") and out.stderr.count("\n") == 1
