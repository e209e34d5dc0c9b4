"""Build the CPU (`Dockerfile`) or GPU (`Dockerfile.gpu`) image with BuildKit.

The build context is staged under build/context: the bundle's code, the Dockerfiles and hard links
(or copies) of the wheelhouse's wheels, which the Dockerfile bind-mounts so they never land in a
layer. A CA bundle for the package index goes in as a BuildKit secret, likewise never stored. Where
the wheelhouse and the CA bundle come from is decided in one place, `ddpack.images.build_inputs`; a
`--dry-run` prints what a build would use. The base defaults to python:3.11-slim-bookworm and falls
back to a base built from Debian's archive (`ddpack.images.base`) when that cannot be pulled.

With `--app DIR` (`make image APP=DIR`) the bundle's image is built as `--bundle-tag`, then a user's project
goes on top of it as `--tag` (docker/app.Dockerfile, `ddpack.images.app`): its requirements in one layer with torch
held fixed, its code in the last. The project is read and checked before anything is built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docker.errors import APIError, ContainerError, ImageNotFound

from ddpack.errors import HostError, run_verb
from ddpack.images.app import App, check_torch_requirements, describe, left_out_note, read_app, stage_app
from ddpack.images.app import build_args as app_build_args
from ddpack.images.base import LOCAL_BASE, build_base
from ddpack.images.build_inputs import BuildInputs, check_wheels_run_on, read_pip_settings, resolve_build_inputs
from ddpack.images.engine import buildkit_cli, docker_client

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BASE = "python:3.11-slim-bookworm"
DEFAULT_TORCH_VERSION = "2.13.0"
CONTEXT_ITEMS = ("pyproject.toml", "Dockerfile", "Dockerfile.gpu", "entrypoint", "train", "ddpack_run", "docker")
APP_DOCKERFILE = "docker/app.Dockerfile"
# The one line docker/install-app.py ends a failed app build with; shown as the build's error.
APP_ERROR = "ddpack-app: error: "


@dataclass(frozen=True)
class Variant:
    dockerfile: str
    torch_index: str  # "" = the default package index


VARIANTS = {"cpu": Variant("Dockerfile", "https://download.pytorch.org/whl/cpu"), "gpu": Variant("Dockerfile.gpu", "")}


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


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


@dataclass(frozen=True, kw_only=True)
class ImageBuild:
    """One build, named by keyword: what to build, from what, and what to call it."""

    variant: str
    tag: str
    inputs: BuildInputs
    base: str | None = None  # None: DEFAULT_BASE, else LOCAL_BASE when it cannot be pulled
    torch_index: str | None = None  # None: the variant's index, or none when the wheelhouse holds torch
    version: str = "dev"
    extra_args: tuple[str, ...] = ()
    source: Path = ROOT
    app: App | None = None  # a user's project, built on the bundle's image as `tag`
    bundle_tag: str | None = None  # with `app`: what the bundle's image is called (default ddpack:<version>)
    offline: bool = False  # no network in the build: every wheel from the wheelhouse

    @property
    def bundle(self) -> str:
        """The tag of the bundle's own image: `tag`, or with an app the image under it."""
        if self.app is None:
            return self.tag
        return self.bundle_tag or f"ddpack:{self.version}"


def plan_build(*, variant: str, tag: str, environ: Mapping[str, str] = os.environ, **settings: Any) -> ImageBuild:
    """An ImageBuild whose wheelhouse and CA bundle follow the one rule (`ddpack.images.build_inputs`)."""
    if variant not in VARIANTS:
        raise HostError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}", code=2)
    torch_version = environ.get("TORCH_VERSION") or DEFAULT_TORCH_VERSION
    inputs = resolve_build_inputs(variant=variant, torch_version=torch_version, environ=environ, pip=read_pip_settings())
    app = settings.get("app")
    if app is not None:
        check_torch_requirements(app, torch_version + ("+cpu" if variant == "cpu" else ""))
    return ImageBuild(variant=variant, tag=tag, inputs=inputs, **settings)


def base_python(base: str) -> tuple[str, str]:
    """(python tag, machine) of the base image's python3, e.g. ("cp311", "x86_64")."""
    probe = "import platform, sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}', platform.machine())"
    try:
        out = docker_client().containers.run(base, ["python3", "-c", probe], entrypoint=[], remove=True)
    except (APIError, ContainerError) as exc:
        raise HostError(
            f"base image {base} has no working python3 ({str(exc).splitlines()[0][:120]}); choose a Python base image"
        ) from None
    tag, machine = out.decode().split()
    return tag, machine


def docker_build(argv: list[str], env: Mapping[str, str], tag: str) -> str:
    """Run one BuildKit build, streaming its log; returns the image id. A failed app build ends with the
    one line docker/install-app.py printed (exit 2: the project's input), else with where to look."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    app_error = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if APP_ERROR in line:
            app_error = line.split(APP_ERROR, 1)[1].strip()
    if proc.wait() != 0:
        if app_error:
            raise HostError(app_error, code=2)
        raise HostError(f"docker build of {tag} failed (exit {proc.returncode}); the build log above says why")
    image = docker_client().images.get(tag)
    print(f"images: built {tag} {image.short_id} {image.attrs['Size'] / 2**20:,.0f} MiB in {time.monotonic() - started:.0f}s")
    return image.id


def _common_argv(build: ImageBuild, dockerfile: Path, tag: str) -> list[str]:
    argv = [*buildkit_cli().argv, "--progress=plain", "-f", str(dockerfile), "-t", tag]
    if build.inputs.ca_bundle is not None:
        argv += ["--secret", f"id=pip_cert,src={build.inputs.ca_bundle}"]
    if build.offline:
        argv += ["--network", "none"]
    return argv


def build_image(build: ImageBuild) -> str:
    """Build one variant as `build.tag` (with an app: the bundle's image, then the app on it); returns the
    image id. Progress streams to the terminal."""
    spec, inputs = VARIANTS[build.variant], build.inputs
    for note in inputs.notes:
        print(f"images: {note}", flush=True)
    cli = buildkit_cli()
    base_image = resolve_base(build.base)
    python_tag, machine = base_python(base_image)
    check_wheels_run_on(inputs, base=base_image, python_tag=python_tag, machine=machine)
    context = stage_context(build.source / "build" / f"context-{build.variant}", list(inputs.wheels), build.source)
    index = spec.torch_index if build.torch_index is None else build.torch_index
    if build.torch_index is None and inputs.torch_wheels:
        index = ""  # the wheelhouse holds torch; the default index serves its dependencies
    build_args = {
        "BASE_IMAGE": base_image,
        "TORCH_VERSION": inputs.torch_version,
        "TORCH_INDEX_URL": index,
        "VERSION": build.version,
        "REVISION": git_revision(),
    }
    argv = _common_argv(build, context / spec.dockerfile, build.bundle)
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    argv += [*build.extra_args, str(context)]
    torch_from = index or "the package index"
    if inputs.torch_wheels:
        torch_from = f"{inputs.torch_wheels[0].path.name} in {inputs.wheelhouse} ({inputs.wheelhouse_from})"
    ca = f"{inputs.ca_bundle} ({inputs.ca_from})" if inputs.ca_bundle else "none"
    print(f"images: building {build.bundle} ({build.variant}) from {base_image}; torch from {torch_from}; CA bundle {ca}", flush=True)
    image_id = docker_build(argv, cli.env, build.bundle)
    return image_id if build.app is None else build_app_image(build)


def build_app_image(build: ImageBuild) -> str:
    """The user's project on the bundle's image, as `build.tag`."""
    assert build.app is not None
    context = build.source / "build" / f"context-app-{build.variant}"
    stage_context(context, list(build.inputs.wheels), build.source)
    stage_app(build.app, context)
    argv = _common_argv(build, context / APP_DOCKERFILE, build.tag)
    args = {"BUNDLE_IMAGE": build.bundle, "APP_PIP_ARGS": "--no-index" if build.offline else "", **app_build_args(build.app)}
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    argv += [*build.extra_args, str(context)]
    print(f"images: building {build.tag} on {build.bundle}: {describe(build.app)}", flush=True)
    if (note := left_out_note(build.app)) is not None:
        print(note, flush=True)
    return docker_build(argv, buildkit_cli().env, build.tag)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.images.images", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="cpu")
    parser.add_argument("--tag", required=True, help="image reference to create, e.g. ddpack:1a2b3c4")
    parser.add_argument(
        "--base", default=os.environ.get("BASE_IMAGE") or None, help=f"base image (default {DEFAULT_BASE}, else {LOCAL_BASE})"
    )
    parser.add_argument("--wheelhouse", help="folder of wheels (default: WHEELHOUSE, else pip's find-links folders)")
    parser.add_argument("--ca-bundle", help="PEM bundle for TLS to the index (default: CA_BUNDLE, else pip's cert, else SSL_CERT_FILE)")
    parser.add_argument("--torch-version", help=f"torch to install (default: TORCH_VERSION, else {DEFAULT_TORCH_VERSION})")
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX_URL") or None, help="index for torch (default: the variant's)")
    parser.add_argument("--version", default="dev", help="value of the org.opencontainers.image.version label")
    parser.add_argument("--build-arg", action="append", default=[], help="extra KEY=VALUE build argument (e.g. INSTALL_EFA=1)")
    parser.add_argument("--app", help="a project folder to put on top of the bundle (its requirements, then its code at /opt/app)")
    parser.add_argument("--app-cmd", default="", help="with --app: the command `entrypoint` runs when given none, e.g. 'python train.py'")
    parser.add_argument("--bundle-tag", help="with --app: the name of the bundle's image under it (default ddpack:VERSION)")
    parser.add_argument("--offline", action="store_true", help="build with no network: every wheel (torch, the app's) from the wheelhouse")
    parser.add_argument("--dry-run", action="store_true", help="resolve and check the build's inputs, print them as JSON, build nothing")
    opts = parser.parse_args(argv)
    # Flags are another way to set the same variables: one rule resolves both.
    flags = {"WHEELHOUSE": opts.wheelhouse, "CA_BUNDLE": opts.ca_bundle, "TORCH_VERSION": opts.torch_version}
    environ = {**os.environ, **{k: v for k, v in flags.items() if v}}
    extra = tuple(arg for pair in opts.build_arg for arg in ("--build-arg", pair))

    def body() -> int:
        if opts.app_cmd and not opts.app:
            raise HostError("APP_CMD is the command of an APP; set APP to the project folder too", code=2)
        build = plan_build(
            variant=opts.variant,
            tag=opts.tag,
            environ=environ,
            base=opts.base,
            torch_index=opts.torch_index,
            version=opts.version,
            extra_args=extra,
            app=read_app(Path(opts.app), opts.app_cmd) if opts.app else None,
            bundle_tag=opts.bundle_tag,
            offline=opts.offline,
        )
        if opts.dry_run:
            app = {"app": build.app.record(), "bundle": build.bundle} if build.app else {}
            print(json.dumps({"tag": build.tag, "base": build.base, **app, **build.inputs.describe()}, indent=2))
            return 0
        build_image(build)
        return 0

    return run_verb("images", body)


if __name__ == "__main__":
    raise SystemExit(main())
