"""Two unprivileged users of a shared cluster, for the tests that act as a victim and an attacker would.

A shared HyperPod-style cluster has many Unix users on the same nodes (`/tmp` shared, `/fsx` shared); root and the
Slurm admins are trusted, the other users are not (docs/security.md). `VICTIM` runs jobs; `ATTACKER` plants files
where the victim's jobs look. Both get a real login shell and a home folder (enroot copies the user's shell into a
container's /etc/passwd, and Slurm runs a job's script with it). Creating them needs root, as CI has.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class User:
    name: str
    uid: int
    gid: int
    home: str

    def runs(self) -> dict[str, object]:
        """subprocess.run's keywords that run a child as this user (from root), with its own HOME and USER."""
        env = {k: v for k, v in os.environ.items() if k not in ("HOME", "USER", "LOGNAME", "XDG_RUNTIME_DIR")}
        env.update(HOME=self.home, USER=self.name, LOGNAME=self.name)
        return {"user": self.uid, "group": self.gid, "extra_groups": [], "env": env}


VICTIM_NAME = "ddalice"
ATTACKER_NAME = "ddmallory"


class UsersUnavailable(RuntimeError):
    """Why the two test users cannot be had here."""


def ensure_user(name: str) -> User:
    """The user `name`, created (login shell bash, a home folder) when missing."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if os.geteuid() != 0:
            raise UsersUnavailable(f"user {name} does not exist and creating it needs root") from None
        if shutil.which("useradd") is None:
            raise UsersUnavailable("useradd is not installed") from None
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, capture_output=True)
        entry = pwd.getpwnam(name)
    return User(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def victim() -> User:
    return ensure_user(VICTIM_NAME)


def attacker() -> User:
    return ensure_user(ATTACKER_NAME)
