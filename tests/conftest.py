"""Shared fixtures; the helpers the tests share live in testbed/ (the benchmarks use them too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.env import ROOT


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
