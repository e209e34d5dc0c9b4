"""Where an image build takes torch and its CA bundle from: the one place for that rule.

WHEELHOUSE, else the local folders of pip's own `find-links` (PIP_FIND_LINKS or pip's config files):
that is where an air-gapped host keeps its torch wheel, and a build that ignored it would reach for
an index the host cannot reach. CA_BUNDLE, else the bundle pip is told to trust (PIP_CERT or pip's
`cert`), else SSL_CERT_FILE. The Makefile passes through only what the user set; `make image`,
`python -m ddpack.images.images`, the tests and the benchmarks all resolve through `resolve_build_inputs`.

Resolution is pure (environment and pip's settings in, `BuildInputs` out); reading pip's settings is
the one edge, in `read_pip_settings`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpack.errors import HostError

# name-version(-build)?-python-abi-platform.whl, as PEP 427 names wheel files.
WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$")


@dataclass(frozen=True, kw_only=True)
class TorchWheel:
    path: Path
    version: str  # as in the file name, local label included: 2.13.0+cpu
    python: str  # cp311, or a dotted set such as cp311.cp312
    platform: str  # manylinux_2_28_x86_64

    @property
    def local(self) -> str:
        return self.version.partition("+")[2]

    @property
    def public(self) -> str:
        return self.version.partition("+")[0]

    def fits(self, *, variant: str, torch_version: str) -> bool:
        """The CPU image installs exactly `X+cpu`; the GPU image `X` in any build but the CPU one."""
        if self.public != torch_version or not self.platform.startswith(("manylinux", "linux")):
            return False
        return self.local == "cpu" if variant == "cpu" else self.local != "cpu"

    def runs_on(self, *, python_tag: str, machine: str) -> bool:
        """Installable by an interpreter with `python_tag` (cp311) on `machine` (x86_64, aarch64)."""
        return python_tag in self.python.split(".") and self.platform.endswith(machine)


def torch_wheels(folder: Path) -> list[TorchWheel]:
    found = []
    for path in sorted(folder.glob("torch-*.whl")):
        match = WHEEL_RE.match(path.name)
        if match and match["name"] == "torch":
            found.append(TorchWheel(path=path, version=match["version"], python=match["python"], platform=match["platform"]))
    return found


@dataclass(frozen=True, kw_only=True)
class PipSettings:
    """What pip itself would use: its find-links entries and its CA bundle (environment over files)."""

    find_links: tuple[str, ...] = ()
    cert: str | None = None


@dataclass(frozen=True, kw_only=True)
class BuildInputs:
    """What one build installs from; `*_from` names the setting each came from, for the log."""

    variant: str
    torch_version: str
    wheelhouse: Path | None
    wheelhouse_from: str
    torch_wheels: tuple[TorchWheel, ...]  # the torch wheels in it that fit the variant
    wheels: tuple[Path, ...]  # what the build stages: those, and every wheel that is not torch
    ca_bundle: Path | None
    ca_from: str
    notes: tuple[str, ...] = ()

    def describe(self) -> dict[str, object]:
        return {
            "variant": self.variant,
            "torch_version": self.torch_version,
            "wheelhouse": str(self.wheelhouse) if self.wheelhouse else None,
            "wheelhouse_from": self.wheelhouse_from,
            "torch_wheels": [w.path.name for w in self.torch_wheels],
            "ca_bundle": str(self.ca_bundle) if self.ca_bundle else None,
            "ca_from": self.ca_from,
            "notes": list(self.notes),
        }


def _local_folder(entry: str) -> Path | None:
    """A find-links entry as a local folder, or None for an index page or a URL."""
    if entry.startswith("file://"):
        entry = entry[len("file://") :]
    elif "://" in entry:
        return None
    folder = Path(entry).expanduser()
    return folder if folder.is_dir() else None


@dataclass(frozen=True)
class _Folder:
    """One candidate wheel folder, read once."""

    path: Path
    all_torch: tuple[TorchWheel, ...]
    fitting: tuple[TorchWheel, ...]
    others: tuple[Path, ...]

    @classmethod
    def read(cls, path: Path, variant: str, torch_version: str) -> _Folder:
        found = torch_wheels(path)
        fitting = tuple(w for w in found if w.fits(variant=variant, torch_version=torch_version))
        others = tuple(p for p in sorted(path.glob("*.whl")) if not p.name.startswith("torch-"))
        return cls(path, tuple(found), fitting, others)


def _resolve_wheelhouse(
    environ: Mapping[str, str], pip: PipSettings, variant: str, torch_version: str
) -> tuple[_Folder | None, str, tuple[str, ...]]:
    wanted = f"torch {torch_version}{'+cpu' if variant == 'cpu' else ' (not +cpu)'}"
    if environ.get("WHEELHOUSE"):
        path = Path(environ["WHEELHOUSE"])
        if not path.is_dir():
            raise HostError(f"WHEELHOUSE={path} is not a directory; point it at a folder of .whl files, or unset it", code=2)
        folder = _Folder.read(path, variant, torch_version)
        if not folder.fitting:
            have = ", ".join(w.path.name for w in folder.all_torch) or "no torch wheel"
            raise HostError(
                f"WHEELHOUSE={path} holds no {wanted} wheel for the {variant} image ({have}); "
                f"add one, set TORCH_VERSION, or unset WHEELHOUSE to use the package index",
                code=2,
            )
        return folder, "WHEELHOUSE", ()
    paths = [f for f in (_local_folder(e) for e in pip.find_links) if f is not None]
    for path in paths:
        folder = _Folder.read(path, variant, torch_version)
        if folder.fitting:
            return folder, "pip find-links", ()
    notes: tuple[str, ...] = ()
    if paths:
        where = ", ".join(str(f) for f in paths)
        notes = (f"pip's find-links ({where}) holds no {wanted} wheel; torch comes from the package index",)
    return None, "", notes


def _resolve_ca_bundle(environ: Mapping[str, str], pip: PipSettings) -> tuple[Path | None, str]:
    if environ.get("CA_BUNDLE"):
        bundle = Path(environ["CA_BUNDLE"])
        if not bundle.is_file():
            raise HostError(f"CA_BUNDLE={bundle} is not a file; point it at a PEM bundle, or unset it", code=2)
        return bundle, "CA_BUNDLE"
    for value, source in ((pip.cert, "pip cert"), (environ.get("SSL_CERT_FILE"), "SSL_CERT_FILE")):
        if value and Path(value).is_file():
            return Path(value), source
    return None, ""


def resolve_build_inputs(*, variant: str, torch_version: str, environ: Mapping[str, str], pip: PipSettings) -> BuildInputs:
    """The build's wheelhouse and CA bundle from the environment and pip's settings; bad input is a
    one-line HostError (exit 2) before anything is built."""
    folder, wheelhouse_from, notes = _resolve_wheelhouse(environ, pip, variant, torch_version)
    ca_bundle, ca_from = _resolve_ca_bundle(environ, pip)
    return BuildInputs(
        variant=variant,
        torch_version=torch_version,
        wheelhouse=folder.path if folder else None,
        wheelhouse_from=wheelhouse_from,
        torch_wheels=folder.fitting if folder else (),
        # Only the fitting torch: `torch==X` also matches a local `X+cpu` wheel, which pip would prefer
        # in a GPU build.
        wheels=tuple(sorted((*(w.path for w in folder.fitting), *folder.others))) if folder else (),
        ca_bundle=ca_bundle,
        ca_from=ca_from,
        notes=notes,
    )


def check_wheels_run_on(inputs: BuildInputs, *, base: str, python_tag: str, machine: str) -> None:
    """After the base is known: a wheelhouse torch the base's Python cannot install is bad input, not a
    build that quietly falls back to an index."""
    if inputs.torch_wheels and not any(w.runs_on(python_tag=python_tag, machine=machine) for w in inputs.torch_wheels):
        names = ", ".join(w.path.name for w in inputs.torch_wheels)
        raise HostError(
            f"{inputs.wheelhouse_from}={inputs.wheelhouse} has torch for another Python or machine ({names}); "
            f"the base {base} runs {python_tag} on {machine}: add a matching wheel or choose another BASE_IMAGE",
            code=2,
        )


def parse_pip_config_list(text: str) -> PipSettings:
    """`pip config list` output -> PipSettings. pip ranks the environment (`:env:`) over the
    `install` section over `global`, and find-links may hold several space-separated entries."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if sep:
            values[key.strip()] = raw.strip().strip("'\"")

    def pick(option: str) -> str | None:
        for section in (":env:", "install", "global"):
            if values.get(f"{section}.{option}"):
                return values[f"{section}.{option}"]
        return None

    links = pick("find-links")
    return PipSettings(find_links=tuple(links.split()) if links else (), cert=pick("cert"))


def read_pip_settings() -> PipSettings:
    """pip's effective find-links and cert, read by asking pip (so its own file and variable rules apply)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return PipSettings()
    return parse_pip_config_list(out.stdout) if out.returncode == 0 else PipSettings()
