"""Setting up the Docker engine on a fresh Debian host: another apt/dpkg holding the lock is waited
for (bounded, with a line saying so), and every failure is one line with a non-zero exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpack.errors import HostError
from ddpack.images.engine import APT_LOCKS, wait_for_apt_locks
from testbed.env import ROOT, clean_env

HOLD = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX);"
    "print('held', flush=True); time.sleep(float(sys.argv[2]))"
)


def hold_lock(path: Path | str, seconds: float) -> subprocess.Popen[str]:
    """Another process holding `path`'s fcntl lock for `seconds`, as apt/dpkg does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_held_lock_is_waited_for_then_given_up_with_one_line(tmp_path: Path, capsys) -> None:
    lock = tmp_path / "lock-frontend"
    holder = hold_lock(lock, 30)
    try:
        started = time.monotonic()
        with pytest.raises(HostError) as err:
            wait_for_apt_locks((str(lock),), timeout_s=1.5, poll_s=0.2)
        assert time.monotonic() - started >= 1.5
        assert holder.poll() is None  # it gave up while the lock was still held, not when the holder let go
    finally:
        holder.kill()
        holder.wait()
    assert f"{lock} is still held by another apt/dpkg after 2s; wait for it to finish" in str(err.value)
    assert capsys.readouterr().out == f"engine: another apt/dpkg holds {lock} (unattended upgrades?); waiting up to 2s\n"


def test_a_lock_released_in_time_lets_the_install_go_on(tmp_path: Path, capsys) -> None:
    lock = tmp_path / "lock"
    holder = hold_lock(lock, 1)
    try:
        left = wait_for_apt_locks((str(lock), str(tmp_path / "absent")), timeout_s=20, poll_s=0.2)
    finally:
        holder.wait()
    assert 10 < left <= 20
    assert "waiting up to 20s" in capsys.readouterr().out
    assert wait_for_apt_locks((str(lock),), timeout_s=5) == pytest.approx(5, abs=0.5)  # free: no line, no wait


def start_engine_with(tmp_path: Path, apt_get: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m ddpack.images.engine --start` where no engine answers, dockerd is not installed and
    `apt-get` is the script given (nothing is really installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\n{apt_get}\n")
    (bin_dir / "apt-get").chmod(0o755)
    env = clean_env(PATH=str(bin_dir), DOCKER_HOST="unix:///tmp/ddpack-no-such.sock", **env)
    return subprocess.run([sys.executable, "-m", "ddpack.images.engine", "--start"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="installing the engine is a root-only path")


@needs_root
def test_an_apt_failure_is_one_line_naming_the_command(tmp_path: Path) -> None:
    out = start_engine_with(tmp_path, "echo 'W: noise' >&2; echo 'E: Could not open lock file' >&2; exit 100")
    assert out.returncode == 1, out.stderr
    assert out.stderr == (
        "ddpack engine: error: apt-get update -qq failed (exit 100): E: Could not open lock file; fix apt, or install them yourself and rerun\n"
    )
    assert "engine: installing Debian's docker.io ..." in out.stdout


@needs_root
@pytest.mark.skipif(not Path(APT_LOCKS[0]).exists(), reason="no dpkg here")
def test_make_engine_waits_for_the_real_dpkg_lock_and_says_so(tmp_path: Path) -> None:
    holder = hold_lock(APT_LOCKS[0], 30)
    try:
        out = start_engine_with(tmp_path, "echo should not run >&2; exit 1", DDPACK_APT_LOCK_WAIT="2")
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1
    assert f"engine: another apt/dpkg holds {APT_LOCKS[0]} (unattended upgrades?); waiting up to 2s" in out.stdout
    assert out.stderr.count("\n") == 1 and "still held by another apt/dpkg after 2s" in out.stderr
    assert "should not run" not in out.stderr and "Traceback" not in out.stderr


def test_a_bad_lock_wait_setting_is_bad_input(tmp_path: Path) -> None:
    out = start_engine_with(tmp_path, "exit 0", DDPACK_APT_LOCK_WAIT="soon")
    if os.geteuid() != 0:
        pytest.skip("the setting is read on the root-only install path")
    assert out.returncode == 2 and out.stderr == "ddpack engine: error: DDPACK_APT_LOCK_WAIT=soon is not a number of seconds\n"
