"""Shared pieces of the Docker tier: an engine or a clear skip (never a skip under CI), and the
images built once per session the way users build them: `python -m ddpack.images.images` in a child process
with only the environment to go on, as `make image` runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from docker.errors import DockerException

import docker
from ddpack.images.images import plan_build

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
    argv = [sys.executable, "-m", "ddpack.images.images", "--variant", variant, "--tag", tag, "--version", "pytest"]
    result = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=3600)
    assert result.returncode == 0, f"{' '.join(argv)} failed (exit {result.returncode}); its log is above"


@dataclass(frozen=True, kw_only=True)
class ReadmeProject:
    """The README's worked project, built, smoked and converted by the README's own command line."""

    folder: Path
    image: str  # cpu-ddp:TAG
    bundle: str  # ddpack:TAG, under it
    sqsh: Path
    output: str  # what the command printed


def build_readme_project(folder: Path) -> ReadmeProject:
    """`make image smoke sqsh APP=../cpu-ddp APP_CMD=...` exactly as the README shows it, with the project
    written from the README into `folder` (named cpu-ddp) in place of ../cpu-ddp."""
    from testbed.readme_examples import readme_line, write_cpu_ddp

    assert folder.name == "cpu-ddp"
    write_cpu_ddp(folder)
    line = readme_line("make image smoke sqsh APP=../cpu-ddp ")
    command = f"{line.replace('../cpu-ddp', str(folder))} VENV={sys.prefix}"
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=3600)
    said = [line for line in out.stdout.splitlines() if line.startswith(("smoke[", "images:", "sqsh:")) or "Error" in line or "error:" in line]
    assert out.returncode == 0, (  # the verdicts and the first errors first: the tail alone can be one rank's C++ frames
        f"{command} failed (exit {out.returncode}):\n" + "\n".join(said[:40]) + f"\n...\n{out.stdout[-4000:]}\n{out.stderr[-3000:]}"
    )
    built = re.search(r"^images: building (\S+) on (\S+): app cpu-ddp ", out.stdout, re.M)
    assert built, out.stdout
    sqsh = ROOT / "build" / f"{built[1].replace(':', '+')}.sqsh"  # make sqsh's default SQSH
    assert f"sqsh: {sqsh} already holds" in out.stdout or f"sqsh: wrote {sqsh}" in out.stdout, out.stdout
    return ReadmeProject(folder=folder, image=built[1], bundle=built[2], sqsh=sqsh, output=out.stdout)
