"""Host verbs from the command line: bad input and a missing engine are one line, non-zero exit."""

from __future__ import annotations

import subprocess
import sys

from testbed.env import ROOT, clean_env


def host(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], env=clean_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_engine_is_one_line_naming_the_socket_and_the_fix() -> None:
    out = host("ddpack.images.engine", DOCKER_HOST="unix:///tmp/ddpack-no-such.sock")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("ddpack engine: error: no Docker engine reachable at unix:///tmp/ddpack-no-such.sock")
    assert "make engine" in out.stderr


def test_unknown_variant_is_rejected() -> None:
    out = host("ddpack.images.images", "--tag", "x:y", "--variant", "tpu")
    assert out.returncode == 2 and "invalid choice: 'tpu'" in out.stderr
