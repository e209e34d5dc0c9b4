"""Build the CPU (`Dockerfile`) or GPU (`Dockerfile.gpu`) image with BuildKit.

The build context is staged under build/context: the bundle's code, the Dockerfiles and, when
WHEELHOUSE is given, hard links (or copies) of its wheels, which the Dockerfile bind-mounts so
they never land in a layer. A CA bundle for the package index goes in as a BuildKit secret, likewise
never stored. The base defaults to python:3.11-slim-bookworm and falls back to a base built from
Debian's archive (`ddpack.base`) when that cannot be pulled.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from docker.errors import APIError, ImageNotFound

from ddpack.base import LOCAL_BASE, build_base
from ddpack.engine import buildkit_cli, docker_client
from ddpack.errors import HostError, run_verb

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = "python:3.11-slim-bookworm"
CONTEXT_ITEMS = ("pyproject.toml", "Dockerfile", "Dockerfile.gpu", "entrypoint", "train", "docker")


@dataclass(frozen=True)
class Variant:
    dockerfile: str
    torch_index: str  # "" = the default package index
    wheel_ok: Callable[[str], bool]  # which wheelhouse files this variant may install from


VARIANTS = {
    "cpu": Variant("Dockerfile", "https://download.pytorch.org/whl/cpu", lambda name: True),
    # `torch==X` also matches a local `X+cpu` wheel, which pip would prefer: keep those out of GPU builds.
    "gpu": Variant("Dockerfile.gpu", "", lambda name: "+cpu" not in name),
}


def resolve_base(requested: str | None) -> str:
    """The base to build FROM: the requested one (local or pulled), or for the default base, the
    Debian-archive base when the registry is out of reach."""
    client = docker_client()
    base = requested or DEFAULT_BASE
    try:
        client.images.get(base)
        return base
    except ImageNotFound:
        pass
    print(f"images: pulling {base} ...", flush=True)
    try:
        client.images.pull(base)
        return base
    except APIError as exc:
        reason = (exc.explanation or str(exc)).splitlines()[0][:160]
        if requested:
            raise HostError(
                f"base image {base} is not here and cannot be pulled ({reason}); pull or build it, or unset BASE_IMAGE"
            ) from None
        print(f"images: cannot pull {base} ({reason}); using {LOCAL_BASE}, built from Debian's archive", flush=True)
    try:
        client.images.get(LOCAL_BASE)
    except ImageNotFound:
        build_base(LOCAL_BASE)
    return LOCAL_BASE


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def check_wheelhouse(wheelhouse: Path | None) -> list[Path]:
    """The wheels of a WHEELHOUSE, or a one-line error when it is not a folder of wheels."""
    if wheelhouse is None:
        return []
    if not wheelhouse.is_dir():
        raise HostError(f"WHEELHOUSE={wheelhouse} is not a directory; point it at a folder of .whl files", code=2)
    found = sorted(wheelhouse.glob("*.whl"))
    if not found:
        raise HostError(f"WHEELHOUSE={wheelhouse} has no .whl files; put the torch wheel (and any others) there", code=2)
    return found


def stage_context(dest: Path, wheels: list[Path], source: Path = ROOT) -> Path:
    """A fresh build context with only what the Dockerfiles use, taken from the checkout `source`."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for item in CONTEXT_ITEMS:
        src = source / item
        if src.is_dir():
            shutil.copytree(src, dest / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / item)
    (dest / "wheelhouse").mkdir()
    for wheel in wheels:
        _link_or_copy(wheel, dest / "wheelhouse" / wheel.name)
    return dest


def default_wheelhouse() -> Path | None:
    """WHEELHOUSE, else the find-links folder of the user's pip config (where a local torch wheel lives)."""
    if os.environ.get("WHEELHOUSE"):
        return Path(os.environ["WHEELHOUSE"])
    links = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    ).stdout.strip()
    return Path(links) if links and Path(links).is_dir() else None


def default_ca_bundle() -> Path | None:
    """CA_BUNDLE, else the bundle pip or OpenSSL are told to trust, when it exists."""
    for name in ("CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE"):
        value = os.environ.get(name)
        if value and (name == "CA_BUNDLE" or Path(value).is_file()):
            return Path(value)
    return None


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


def build_image(
    variant: str,
    tag: str,
    base: str | None = None,
    wheelhouse: Path | None = None,
    ca_bundle: Path | None = None,
    torch_version: str = "2.13.0",
    torch_index: str | None = None,
    version: str = "dev",
    extra_args: tuple[str, ...] = (),
    source: Path = ROOT,
) -> str:
    """Build one variant as `tag`; returns the image id. Progress streams to the terminal."""
    if variant not in VARIANTS:
        raise HostError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}", code=2)
    if ca_bundle is not None and not ca_bundle.is_file():
        raise HostError(f"CA_BUNDLE={ca_bundle} is not a file; unset it or point it at a PEM bundle", code=2)
    spec = VARIANTS[variant]
    wheels = [w for w in check_wheelhouse(wheelhouse) if spec.wheel_ok(w.name)]
    cli = buildkit_cli()
    base_image = resolve_base(base)
    context = stage_context(source / "build" / f"context-{variant}", wheels, source)
    index = spec.torch_index if torch_index is None else torch_index
    if torch_index is None and list((context / "wheelhouse").glob("torch-*.whl")):
        index = ""  # the wheelhouse holds torch; the default index serves its dependencies
    build_args = {
        "BASE_IMAGE": base_image,
        "TORCH_VERSION": torch_version,
        "TORCH_INDEX_URL": index,
        "VERSION": version,
        "REVISION": git_revision(),
    }
    argv = [*cli.argv, "--progress=plain", "-f", str(context / spec.dockerfile), "-t", tag]
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    if ca_bundle is not None:
        argv += ["--secret", f"id=pip_cert,src={ca_bundle}"]
    argv += [*extra_args, str(context)]
    print(f"images: building {tag} ({variant}) from {base_image}", flush=True)
    started = time.monotonic()
    result = subprocess.run(argv, env={**os.environ, **cli.env})
    if result.returncode != 0:
        raise HostError(f"docker build of {tag} failed (exit {result.returncode}); the build log above says why")
    image = docker_client().images.get(tag)
    print(f"images: built {tag} {image.short_id} {image.attrs['Size'] / 2**20:,.0f} MiB in {time.monotonic() - started:.0f}s")
    return image.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.images", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="cpu")
    parser.add_argument("--tag", required=True, help="image reference to create, e.g. ddpack:1a2b3c4")
    parser.add_argument(
        "--base", default=os.environ.get("BASE_IMAGE") or None, help=f"base image (default {DEFAULT_BASE}, else {LOCAL_BASE})"
    )
    parser.add_argument("--wheelhouse", type=Path, default=None, help="default: WHEELHOUSE, else pip's find-links folder")
    parser.add_argument("--ca-bundle", type=Path, default=None, help="default: CA_BUNDLE, else PIP_CERT or SSL_CERT_FILE")
    parser.add_argument("--torch-version", default=os.environ.get("TORCH_VERSION", "2.13.0"))
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX_URL") or None, help="index for torch (default: the variant's)")
    parser.add_argument("--version", default="dev", help="value of the org.opencontainers.image.version label")
    parser.add_argument("--build-arg", action="append", default=[], help="extra KEY=VALUE build argument (e.g. INSTALL_EFA=1)")
    opts = parser.parse_args(argv)
    extra = tuple(arg for pair in opts.build_arg for arg in ("--build-arg", pair))
    return run_verb(
        "images",
        lambda: (
            build_image(
                opts.variant,
                opts.tag,
                opts.base,
                opts.wheelhouse,
                opts.ca_bundle,
                opts.torch_version,
                opts.torch_index,
                opts.version,
                extra,
            )
            and 0
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
