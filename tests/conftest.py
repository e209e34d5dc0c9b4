"""Shared fixtures: the repository root on PYTHONPATH for child processes, and a clean environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Variables a launcher reads; a test's child process must not inherit them from the CI shell.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "NNODES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "DDPACK_BACKEND",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without Slurm, torchrun or launcher variables, plus `extra`, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(ROOT)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, also on a machine with GPUs
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def readme_project(tmp_path_factory: pytest.TempPathFactory):
    """The README's worked project (cpu-ddp) built on the bundle, smoked and converted by the README's own
    command line, once per session: the Docker tier checks the image, the pyxis tier runs its squashfs."""
    from docker_support import build_readme_project, engine_or_skip

    engine_or_skip()
    return build_readme_project(tmp_path_factory.mktemp("project") / "cpu-ddp")
