"""Reaching a Docker engine (docker SDK) and a BuildKit-capable docker CLI; starting dockerd on Debian.

`python -m ddpack.engine [--start]` checks the engine, and with --start (root, Debian) installs
docker.io if needed and starts dockerd in the background.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

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


def ensure_debian_packages(command: str, packages: tuple[str, ...]) -> None:
    """Make `command` available, installing Debian packages when root on a Debian-like host."""
    if shutil.which(command) is not None:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HostError(
            f"{command} is not installed; install {' '.join(packages)} (as root on Debian: apt-get install -y {' '.join(packages)})"
        )
    print(f"installing Debian's {' '.join(packages)} for {command} ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=True, env=env, stdout=subprocess.DEVNULL)


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
        print("engine: installing Debian's docker.io ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "docker.io"], check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        )
    print(f"engine: starting dockerd (log: {DOCKERD_LOG})", flush=True)
    with open(DOCKERD_LOG, "ab") as log:
        subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            docker.from_env(timeout=5).ping()
            print("engine: dockerd is up")
            return
        except DockerException:
            time.sleep(0.5)
    raise HostError(f"dockerd did not answer within {wait_s:.0f}s; see {DOCKERD_LOG}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpack.engine", description=__doc__)
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
