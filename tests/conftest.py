"""Shared fixtures; the helpers the tests share live in testbed/ (the benchmarks use them too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.env import ROOT
from testbed.slurm_cluster import ClusterUnavailable, ensure_cluster

if TYPE_CHECKING:
    from docker_support import ReadmeProject
    from torch.distributed import TCPStore


# The host's packages (pyproject.toml's `dev` extra) that test modules import, directly or through ddpack's host side.
# A GPU machine lent for `make gpu-check` has torch and pytest alone: there the modules that need these are skipped
# at collection, so `pytest -m gpu` from the root reaches the GPU tests. Under CI a missing one still fails.
HOST_EXTRAS = frozenset({"docker", "boto3", "botocore", "moto", "hostlist", "bcrypt", "requests", "matplotlib", "tensorboard"})


class _TestModule(pytest.Module):
    """A test module whose import fails for want of a host extra is skipped with one line naming it."""

    def _getobj(self):  # type: ignore[no-untyped-def]
        try:
            return super()._getobj()
        except self.CollectError as error:
            missing = error.__cause__
            if isinstance(missing, ModuleNotFoundError) and (missing.name or "").split(".")[0] in HOST_EXTRAS and not os.environ.get("CI"):
                pytest.skip(f"needs the host package {missing.name.split('.')[0]} (pip install -e '.[dev]')", allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.name.startswith("test_"):
        return _TestModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def server() -> Iterator[TCPStore]:
    """A store served as rank 0, torchrun's agent or the store task serves the job's rendezvous store, on a free loopback
    port: the tests of the watchdog's and the recovery channel's keys, the node beats' and the standbys' talk to it.
    torch is imported here, not at the top: the session's start does not wait for it."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield store
    del store


@pytest.fixture(scope="session")
def readme_project(tmp_path_factory: pytest.TempPathFactory):
    """The README's worked project (cpu-ddp) built on the bundle, smoked and converted by the README's own
    command line, once per session: the Docker tier checks the image, the pyxis tier runs its squashfs."""
    from docker_support import build_readme_project, engine_or_skip

    engine_or_skip()
    return build_readme_project(tmp_path_factory.mktemp("project") / "cpu-ddp")


@pytest.fixture(scope="session")
def cpu_image() -> str:
    """The bundle's CPU image (docker_support.TEST_TAG), built as a user builds it once per session for every module
    that runs it (each asked the build command again, which then found everything in its cache)."""
    from docker_support import TEST_TAG, build, engine_or_skip

    engine_or_skip()
    build("cpu", TEST_TAG)
    return TEST_TAG


# --------------------------------------------------------------- the pyxis tier's cluster, shared folder and image


def _missing_stack() -> str | None:
    if shutil.which("enroot") is None:
        return "enroot is not installed (../shared/tools/install-enroot-pyxis.sh)"
    if "--container-image" not in subprocess.run(["srun", "--help"], capture_output=True, text=True).stdout:
        return "pyxis is not enabled (install-enroot-pyxis.sh --enable-pyxis)"
    return None


@pytest.fixture(scope="session")
def pyxis_stack() -> None:
    """The test cluster with pyxis and enroot: started when it can be, a failure under CI, else a skip."""
    try:
        ensure_cluster()
    except ClusterUnavailable as exc:
        missing: str | None = str(exc)
    else:
        missing = _missing_stack()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide Slurm with pyxis and enroot: {missing}")
        pytest.skip(missing)


@pytest.fixture(autouse=True)
def cluster_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """A Slurm or pyxis test hands the next one the cluster it found: a job it left (a held job whose test failed
    mid-wait, a queued one) is cancelled and waited out, a partition or node it set down is up again. Without this
    one failed wait became five: each later test's job queued behind or beside the one left running."""
    yield
    if request.node.get_closest_marker("slurm") is None and request.node.get_closest_marker("pyxis") is None:
        return
    from testbed.slurm_cluster import restore_cluster

    left = restore_cluster()
    if left:
        print(f"\n{request.node.nodeid} left the cluster changed; restored: {left}", file=sys.stderr)


@pytest.fixture(scope="session")
def shared() -> Iterator[Path]:
    """A folder every job user can write, standing in for /fsx."""
    folder = Path(tempfile.mkdtemp(prefix="ddpack-fsx-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def sqsh(shared: Path, readme_project: ReadmeProject) -> Path:
    """The README's `cp build/cpu-ddp+TAG.sqsh /fsx/images/cpu-ddp.sqsh`, into the shared folder."""
    (shared / "images").mkdir(mode=0o755)
    output = shared / "images" / "cpu-ddp.sqsh"
    shutil.copyfile(readme_project.sqsh, output)
    output.chmod(0o644)
    return output


# --------------------------------------------------------------- two users of a shared node


@pytest.fixture(scope="session")
def users():  # type: ignore[no-untyped-def]
    """(victim, attacker): two unprivileged users (testbed/users.py), made when missing; a skip where they cannot
    be (not root), a failure under CI."""
    from testbed.users import UsersUnavailable, attacker, victim

    try:
        return victim(), attacker()
    except UsersUnavailable as why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide two unprivileged users: {why}")
        pytest.skip(str(why))


@pytest.fixture
def node_tmp() -> Iterator[Path]:
    """A node's /tmp: owned by root, sticky, writable by everyone."""
    base = Path(tempfile.mkdtemp(prefix="ddpack-node-tmp-"))
    base.chmod(0o1777)
    yield base
    subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)
