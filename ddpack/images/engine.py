"""Reaching a Docker engine (docker SDK) and a BuildKit-capable docker CLI; starting dockerd on Debian.

`python -m ddpack.images.engine [--start]` checks the engine, and with --start (root, Debian) installs
docker.io if needed and starts dockerd in the background.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from docker.errors import DockerException

import docker
from ddpack.errors import HostError, run_verb

DOCKERD_LOG = "/var/log/ddpack-dockerd.log"


def docker_client(timeout: int = 600) -> docker.DockerClient:
    """A client for the engine DOCKER_HOST (or the default socket) names, or a one-line error."""
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except DockerException as exc:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        reason = str(exc).splitlines()[0][:160]
        raise HostError(
            f"no Docker engine reachable at {where} ({reason}); start one: `make engine` (Debian, as root) or your Docker service"
        ) from None
    return client


@dataclass(frozen=True)
class BuildCli:
    """How to run a BuildKit build: argv prefix and extra environment."""

    argv: tuple[str, ...]
    env: dict[str, str]


def _version_major(binary: str) -> int | None:
    try:
        out = subprocess.run([binary, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    try:
        return int(out.stdout.strip().split(".")[0])
    except ValueError:
        return None


def buildkit_cli() -> BuildCli:
    """`docker buildx build --load` where buildx exists; else a client with BuildKit built in (20.10-22.x,
    such as Debian's /usr/bin/docker) with DOCKER_BUILDKIT=1. The Dockerfiles need BuildKit for
    secret and bind mounts, which keep the CA bundle and wheels out of every layer."""
    candidates = [c for c in dict.fromkeys([shutil.which("docker"), "/usr/bin/docker"]) if c and os.path.exists(c)]
    for binary in candidates:
        probe = subprocess.run([binary, "buildx", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return BuildCli((binary, "buildx", "build", "--load"), {})
    for binary in candidates:
        major = _version_major(binary)
        if major is not None and 18 <= major < 23:
            return BuildCli((binary, "build"), {"DOCKER_BUILDKIT": "1"})
    raise HostError("no docker CLI with BuildKit found; install docker-buildx (docker-ce) or Debian's docker.io (/usr/bin/docker 20.10)")


# dpkg's and apt's locks (fcntl locks, as apt takes them); unattended-upgrades holds them for minutes.
APT_LOCKS = ("/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock")
APT_LOCK_WAIT_S = 300.0  # DDPACK_APT_LOCK_WAIT overrides it


def apt_lock_wait_s() -> float:
    try:
        return float(os.environ.get("DDPACK_APT_LOCK_WAIT") or APT_LOCK_WAIT_S)
    except ValueError:
        raise HostError(f"DDPACK_APT_LOCK_WAIT={os.environ['DDPACK_APT_LOCK_WAIT']} is not a number of seconds", code=2) from None


def _lock_held(path: str) -> bool:
    """True when another process holds the fcntl lock on `path` (taking it here and releasing it at once)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False  # no such lock file, or not ours to open: nothing to wait for
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the lock if it was taken
    return False


def wait_for_apt_locks(locks: tuple[str, ...], timeout_s: float, poll_s: float = 1.0) -> float:
    """Wait until no other apt/dpkg holds its locks; returns the seconds left of `timeout_s`. One line
    says who we wait for; after `timeout_s` a one-line error says what to do."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        held = [lock for lock in locks if _lock_held(lock)]
        if not held:
            return max(1.0, deadline - time.monotonic())
        if not announced:
            print(f"engine: another apt/dpkg holds {held[0]} (unattended upgrades?); waiting up to {timeout_s:.0f}s", flush=True)
            announced = True
        if time.monotonic() >= deadline:
            raise HostError(
                f"{held[0]} is still held by another apt/dpkg after {timeout_s:.0f}s; wait for it to finish (ps -C apt-get,dpkg,unattended-upgr) and rerun"
            )
        time.sleep(poll_s)


def _apt(args: list[str], wait_s: float) -> None:
    argv = ["apt-get", "-o", f"DPkg::Lock::Timeout={int(wait_s)}", *args]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        result = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise HostError(f"cannot run apt-get ({exc.strerror}); install the packages yourself") from None
    if result.returncode != 0:
        errors = (
            [line for line in result.stderr.splitlines() if line.startswith("E:")] or result.stderr.strip().splitlines() or ["no message"]
        )
        raise HostError(
            f"apt-get {' '.join(args)} failed (exit {result.returncode}): {errors[-1][:200]}; fix apt, or install them yourself and rerun"
        )


def apt_install(packages: tuple[str, ...], locks: tuple[str, ...] = APT_LOCKS) -> None:
    """apt-get update + install, waiting (bounded) for another apt/dpkg to finish first."""
    wait_s = apt_lock_wait_s()
    print(f"engine: installing Debian's {' '.join(packages)} ...", flush=True)
    _apt(["update", "-qq"], wait_for_apt_locks(locks, wait_s))
    _apt(["install", "-y", "-qq", *packages], wait_for_apt_locks(locks, wait_s))


def ensure_debian_packages(command: str, packages: tuple[str, ...]) -> None:
    """Make `command` available, installing Debian packages when root on a Debian-like host."""
    if shutil.which(command) is not None:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HostError(
            f"{command} is not installed; install {' '.join(packages)} (as root on Debian: apt-get install -y {' '.join(packages)})"
        )
    apt_install(packages)


def start_engine(wait_s: float = 60) -> None:
    """Install Debian's docker.io when dockerd is missing, start dockerd in the background, wait for it."""
    try:
        docker.from_env(timeout=5).ping()
        print("engine: a Docker engine is already running")
        return
    except DockerException:
        pass
    if os.geteuid() != 0:
        raise HostError("starting a Docker engine needs root; run `sudo make engine` or start your Docker service")
    if shutil.which("dockerd") is None:
        if shutil.which("apt-get") is None:
            raise HostError("dockerd is not installed and this is not a Debian-like system; install Docker for your OS")
        apt_install(("docker.io",))
    print(f"engine: starting dockerd (log: {DOCKERD_LOG})", flush=True)
    try:
        with open(DOCKERD_LOG, "ab") as log:
            daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise HostError(f"cannot start dockerd ({exc.strerror}); is docker.io installed?") from None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            docker.from_env(timeout=5).ping()
            print("engine: dockerd is up")
            return
        except DockerException:
            if daemon.poll() is not None:
                raise HostError(f"dockerd exited ({daemon.returncode}): {_last_line(DOCKERD_LOG)}; see {DOCKERD_LOG}") from None
            time.sleep(0.5)
    raise HostError(f"dockerd did not answer within {wait_s:.0f}s: {_last_line(DOCKERD_LOG)}; see {DOCKERD_LOG}")


def _last_line(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no log"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpack.images.engine", description=__doc__)
    parser.add_argument("--start", action="store_true", help="start dockerd if none is running (root, Debian)")
    opts = parser.parse_args(argv)

    def body() -> None:
        if opts.start:
            start_engine()
        else:
            version = docker_client().version()
            print(f"engine: Docker {version.get('Version')} (API {version.get('ApiVersion')})")

    return run_verb("engine", body)


if __name__ == "__main__":
    raise SystemExit(main())
