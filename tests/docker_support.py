"""Shared pieces of the Docker tier: an engine or a clear skip (never a skip under CI), and the
images built once per session the way users build them: `python -m ddpack.images` in a child process
with only the environment to go on, as `make image` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docker.errors import DockerException

import docker
from ddpack.images import plan_build

ROOT = Path(__file__).resolve().parents[1]
TEST_TAG = "ddpack:pytest"
TEST_GPU_TAG = "ddpack:pytest-gpu"


def engine_or_skip() -> docker.DockerClient:
    try:
        client = docker.from_env(timeout=900)
        client.ping()
        return client
    except DockerException as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide a Docker engine: {exc}")
        pytest.skip(f"no Docker engine here ({exc}); `make engine` starts one")


def host_ca_bundle() -> Path | None:
    """The CA bundle a build on this host gets (the same rule the build command follows)."""
    return plan_build(variant="cpu", tag="unused").inputs.ca_bundle


def build(variant: str, tag: str) -> None:
    """Build as a user does; no setting is filled in here, so a default the command drops fails the build."""
    argv = [sys.executable, "-m", "ddpack.images", "--variant", variant, "--tag", tag, "--version", "pytest"]
    result = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=3600)
    assert result.returncode == 0, f"{' '.join(argv)} failed (exit {result.returncode}); its log is above"
