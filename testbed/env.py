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


# Whether child processes see this machine's GPUs. Off: every test runs its ranks on the CPU with gloo, also on a
# machine with GPUs, so that a result never depends on the machine. The GPU tier (tests/test_gpu.py) turns it on for
# its own tests alone: hidden there too, its ranks would train on the CPU and test nothing of CUDA.
gpus_visible = False


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without Slurm, torchrun or launcher variables, plus `extra`, with the repo importable; the GPUs
    hidden unless `gpus_visible` (then as this process sees them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(ROOT)
    if not gpus_visible:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env
