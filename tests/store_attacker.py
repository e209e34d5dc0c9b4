"""Another user of a shared cluster, writing into a job's rendezvous store (tests of the watchdog's and in-process
recovery's signed keys): a program run as the unprivileged ddmallory when the tests run as root, with the node's own
python3 and the venv's torch (root's interpreter is not readable by other users), else as this user in a process of
its own (the store does not tell users apart either way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from testbed.users import UsersUnavailable, attacker


def run_as_another_user(program: str, *argv: object) -> tuple[subprocess.Popen[str], int]:
    """`python3 -c program argv...` started as the attacker: (its process, its uid). Its stdout is a pipe."""
    args = [str(a) for a in argv]
    site = str(Path(torch.__file__).resolve().parents[1])
    system_python = Path("/usr/bin/python3")
    if os.geteuid() == 0 and system_python.exists():
        try:
            user = attacker()
        except UsersUnavailable:
            user = None
        same = subprocess.run([str(system_python), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if user is not None and same.stdout.strip() == str(sys.version_info[:2]):
            runs = user.runs()
            runs["env"] = {**runs["env"], "PYTHONPATH": site}  # type: ignore[dict-item]
            return subprocess.Popen(
                [str(system_python), "-c", program, *args], stdout=subprocess.PIPE, text=True, cwd="/", **runs
            ), user.uid  # type: ignore[arg-type]
    return subprocess.Popen([sys.executable, "-c", program, *args], stdout=subprocess.PIPE, text=True), os.getuid()
