"""A base image built offline from Debian's archive, for hosts that cannot pull `python:3.11-slim`.

debootstrap (minbase) + python3, venv and CA certificates, imported with `docker import`. It stands in
for the slim Python image: same Debian release, Python 3.11, /bin/sh, apt. `make base` runs it;
`make image` runs it automatically when the base image can be neither found nor pulled.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from ddpack.errors import HostError, run_verb
from ddpack.images.engine import docker_client, ensure_debian_packages

LOCAL_BASE = "ddpack-base:bookworm-py311"
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")


def build_base(tag: str = LOCAL_BASE, suite: str = "bookworm", mirror: str | None = None) -> str:
    """debootstrap a minimal root filesystem and import it as `tag`; returns the image id."""
    if os.geteuid() != 0:
        raise HostError("debootstrap needs root to build the base image; run as root or pull a base (BASE_IMAGE=...)")
    ensure_debian_packages("debootstrap", ("debootstrap",))
    client = docker_client()
    with tempfile.TemporaryDirectory(prefix="ddpack-base-") as tmp:
        root = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(root)]
        if mirror:
            cmd.append(mirror)
        print(f"base: debootstrap {suite} with {', '.join(PACKAGES)} (about a minute)", flush=True)
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            tail = " | ".join(result.stdout.strip().splitlines()[-2:])
            raise HostError(f"debootstrap failed ({result.returncode}): {tail}")
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for entry in (root / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tarball), "."], check=True)
        repository, _, version = tag.rpartition(":") if ":" in tag else (tag, "", "latest")
        print(f"base: importing {tarball.stat().st_size / 2**20:.0f} MiB as {tag}", flush=True)
        client.api.import_image(
            src=str(tarball),
            repository=repository,
            tag=version,
            changes=["ENV LANG=C.UTF-8", 'CMD ["python3"]', f'LABEL io.ddpack.base="debootstrap {suite}"'],
        )
    image = client.images.get(tag)
    print(f"base: {tag} {image.short_id} {image.attrs['Size'] / 2**20:.0f} MiB")
    return image.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpack.images.base", description=__doc__)
    parser.add_argument("--tag", default=LOCAL_BASE, help="image name to create")
    parser.add_argument("--suite", default="bookworm", help="Debian release (bookworm has Python 3.11, matching cp311 torch wheels)")
    parser.add_argument("--mirror", default=os.environ.get("DEBIAN_MIRROR") or None, help="Debian mirror URL (default: debootstrap's)")
    opts = parser.parse_args(argv)
    return run_verb("base", lambda: build_base(opts.tag, opts.suite, opts.mirror) and 0)


if __name__ == "__main__":
    raise SystemExit(main())
