"""The repository's root and an environment for child processes that no launcher variable leaks into."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

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
