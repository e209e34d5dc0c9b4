"""`make sqsh` natively (no enroot here): enroot's layout and metadata, atomic output, and the trainer
running from the unpacked root filesystem as a non-root uid with a login shell, as pyxis runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env
from docker_support import TEST_TAG, build, engine_or_skip

from ddpack.errors import HostError
from ddpack.sqsh import convert, enroot_metadata

pytestmark = pytest.mark.docker


def need(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install {package}")
        pytest.skip(f"{tool} is not installed ({package})")


@pytest.fixture(scope="module")
def sqsh(tmp_path_factory) -> Path:
    engine_or_skip()
    need("mksquashfs", "squashfs-tools")
    build("cpu", TEST_TAG)
    return convert(TEST_TAG, tmp_path_factory.mktemp("sqsh") / "ddpack.sqsh", "mksquashfs")


def cat(sqsh: Path, member: str) -> str:
    return subprocess.run(["unsquashfs", "-cat", str(sqsh), member], capture_output=True, text=True, check=True).stdout


def test_metadata_follows_enroot(sqsh: Path) -> None:
    environment = cat(sqsh, "etc/environment").splitlines()
    assert "PATH=/opt/ddpack/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in environment
    assert "PYTHONPATH=" in environment and "LD_LIBRARY_PATH=" in environment
    rc = cat(sqsh, "etc/rc")
    assert "# io.ddpack.variant cpu" in rc and 'cd "/workspace" && unset OLDPWD || exit 1' in rc
    assert 'exec /usr/local/bin/entrypoint "$@"' in rc
    assert cat(sqsh, "etc/rc.local").startswith("# This file is sourced by /etc/rc")
    assert cat(sqsh, "etc/fstab") == ""


def test_owned_by_root_readable_by_all_without_docker_leftovers(sqsh: Path) -> None:
    listing = subprocess.run(["unsquashfs", "-lln", str(sqsh)], capture_output=True, text=True, check=True).stdout.splitlines()
    lines = [line for line in listing if "squashfs-root" in line]
    assert all(line.split()[1] == "0/0" for line in lines)
    names = {line.split("squashfs-root", 1)[1].split(" -> ")[0] for line in lines}
    assert "/usr/local/bin/entrypoint" in names
    assert "/.dockerenv" not in names and not [n for n in names if n.startswith("/dev/")]
    unreadable = [line for line in lines if line[0] == "-" and line[7] != "r"]
    assert unreadable == []


def test_trainer_runs_from_the_unpacked_root_as_non_root_with_a_login_shell(sqsh: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    subprocess.run(["unsquashfs", "-q", "-d", str(root), str(sqsh)], check=True, stdout=subprocess.DEVNULL)
    # enroot gives a container /proc and /dev; so does this chroot.
    if subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")]).returncode != 0:
        pytest.skip("cannot mount /proc here (needs root)")
    subprocess.run(["mount", "--bind", "/dev", str(root / "dev")], check=True)
    try:
        script = "cd /tmp && command -v entrypoint && python -c 'import torch; print(torch.__version__)' && entrypoint --epochs 1 --snapshot-dir s"
        out = subprocess.run(
            ["/usr/sbin/chroot", "--userspec=4242:4242", str(root), "/bin/sh", "-lc", script],
            env={"PATH": "/host/only/bin:/usr/bin:/bin", "HOME": "/nonexistent", "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["umount", str(root / "proc"), str(root / "dev")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("/usr/local/bin/entrypoint\n2.13.0+cpu\n")
    assert "checksums agree across 1 ranks" in out.stdout and "snapshot saved: s/snapshot-" in out.stdout


def test_tar2sqfs_converter_gives_the_same_tree(sqsh: Path, tmp_path: Path) -> None:
    need("tar2sqfs", "squashfs-tools-ng")
    other = convert(TEST_TAG, tmp_path / "ng.sqsh", "tar2sqfs")

    def tree(path: Path) -> list[str]:
        out = subprocess.run(["unsquashfs", "-lc", str(path)], capture_output=True, text=True, check=True).stdout
        return sorted(line.split("squashfs-root", 1)[1] for line in out.splitlines() if "squashfs-root" in line)

    assert tree(other) == tree(sqsh)
    assert cat(other, "etc/rc") == cat(sqsh, "etc/rc")


def test_output_is_replaced_atomically_and_failures_leave_no_file(sqsh: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.sqsh"
    target.write_bytes(b"previous good file")
    with pytest.raises(HostError, match="the squashfs lacks usr/local/bin/entrypoint"):
        convert("ddpack-base:bookworm-py311", target, "mksquashfs")  # not a ddpack image
    assert target.read_bytes() == b"previous good file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.sqsh"]
    convert(TEST_TAG, target, "mksquashfs")
    assert target.stat().st_size > 100 * 2**20 and sorted(p.name for p in tmp_path.iterdir()) == ["out.sqsh"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--image", "ddpack:never-built", "--output", "/tmp/x.sqsh"], "image ddpack:never-built not found; build it first (make image)"),
        (["--image", TEST_TAG, "--output", "/nonexistent/dir/x.sqsh"], "output folder /nonexistent/dir does not exist"),
        (["--image", TEST_TAG, "--output", "/tmp/x.sqsh", "--converter", "zip"], "converter 'zip' is not one of"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    engine_or_skip()
    out = subprocess.run(
        [sys.executable, "-m", "ddpack.sqsh", *args], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr


def test_missing_tool_is_named(monkeypatch, tmp_path: Path) -> None:
    engine_or_skip()
    monkeypatch.setenv("PATH", str(tmp_path))  # no mksquashfs, no tar, nothing
    with pytest.raises(HostError, match=r"mksquashfs is not installed; install squashfs-tools"):
        convert(TEST_TAG, tmp_path / "x.sqsh", "mksquashfs")
    assert list(tmp_path.iterdir()) == []


def test_metadata_for_an_image_without_entrypoint_or_cmd_runs_a_shell() -> None:
    meta = enroot_metadata({"Env": ["A=1"], "Volumes": {"/data": {}}, "WorkingDir": ""})
    assert 'exec  "$@"' not in meta["etc/rc"] and "exec /bin/sh\n" in meta["etc/rc"]
    assert meta["etc/fstab"] == "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    assert meta["etc/environment"] == "A=1\n"
