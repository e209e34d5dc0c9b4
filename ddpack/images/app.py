"""A user's project on top of a ddpack image (`make image APP=DIR`): what it is and what goes in.

The project is read once, here, into an `App`: its requirements (requirements.txt, else pyproject.toml's
[project] dependencies), its code files (the folder less version-control, caches, virtual environments,
ddpack's own run outputs and whatever its .dockerignore names), a digest of both, its git revision and the
command the image runs by default (APP_CMD). Bad input is one line and exit 2 before anything is built:
a missing folder, a folder with neither requirements nor Python code, an unreadable requirements file, a
requirement pip could not read inside the build (a local path), APP_CMD naming a script the project lacks,
or a requirement on a torch other than the image's.

`stage_app` writes the two parts into the build context apart (`app-deps/` for the dependency layer,
`app/` for the code layer), so a code change rebuilds only the last layer and a requirements change only
the layer before it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from ddpack.errors import HostError
from entrypoint.plan import python_script_index

# Never part of the code layer (the project's code, at /opt/app in the image, docker/app.Dockerfile): version
# control, caches, virtual environments, and what ddpack's templates
# and builds write into a submission folder (runs/ holds snapshots, logs/ the job logs).
ALWAYS_EXCLUDED = (
    ".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache",
    ".ipynb_checkpoints", ".tox", "*.egg-info", "/runs", "/logs", "/build", "/.dockerignore",
)  # fmt: skip
# Left out of the code layer unless the project asks for one on purpose (a `!NAME` line in its .dockerignore): files
# that hold credentials by convention. An image is copied to the squashfs, the registry and every node, and a
# git-ignored .env beside the code is not a file anyone meant to ship. A line at the build names what was left out.
# The cloud and hub tools' own files too, where a home folder copied into a project brings them: AWS (.aws/credentials,
# config), Google Cloud (.config/gcloud/: application_default_credentials.json, credentials.db, access_tokens.db),
# Azure (.azure/: msal_token_cache.json), Hugging Face (~/.cache/huggingface/token and stored_tokens; the older
# ~/.huggingface/token), Docker (.docker/config.json), Kubernetes (.kube/config), direnv's .envrc, and the
# credentials.json of Google's OAuth samples. A pattern with a slash matches from the project's top, `**/` at any depth.
SECRET_PATTERNS = (
    ".env", ".env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", ".netrc", ".pypirc", ".npmrc",
    ".git-credentials", ".htpasswd", "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", ".aws", ".ssh", ".gnupg", ".docker", ".kube",
    "credentials.json", "application_default_credentials.json", ".azure", ".huggingface", "**/.config/gcloud",
    "**/.cache/huggingface/token", "**/.cache/huggingface/stored_tokens",
)  # fmt: skip
# What the app's requirements may not change: torch and the wheels a CUDA torch is built against.
HELD_PACKAGES = ("torch", "triton", "nvidia-*")


def is_held(name: str) -> bool:
    return any(fnmatch.fnmatch(canonicalize_name(name), pattern) for pattern in HELD_PACKAGES)


@dataclass(frozen=True, kw_only=True)
class App:
    """A user's project as the image build takes it."""

    name: str  # the project folder's name
    source: Path
    requirements: tuple[str, ...]  # lines pip reads, -r/-c includes inlined
    requirements_from: str  # "requirements.txt", "pyproject.toml" or "" (none)
    files: tuple[PurePosixPath, ...]  # the code layer, relative to `source`
    left_out: tuple[PurePosixPath, ...] = ()  # likely secrets kept out of the code layer (SECRET_PATTERNS), folders once
    digest: str  # of the files and the requirements: what the preflight compares across ranks
    revision: str  # git commit (with -dirty when the folder has changes), or "" outside a repository
    command: tuple[str, ...]  # APP_CMD as words; () leaves the bundled trainer the default

    def record(self) -> dict[str, object]:
        """The `app` entry of ddpack-build.json, and the labels' source."""
        return {
            "name": self.name,
            "digest": self.digest,
            "revision": self.revision,
            "command": shlex.join(self.command),
            "requirements_from": self.requirements_from,
        }


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HostError(f"APP's {what} {path} cannot be read ({reason}); make it a readable text file", code=2) from None


def _include(line: str) -> tuple[str, str] | None:
    """("-r" or "-c", file) for an include line in any of pip's spellings, else None."""
    match = re.match(r"^(-r|-c|--requirement|--constraint)(?:\s*=\s*|\s+|(?<=^-r)|(?<=^-c))(\S+)$", line)
    if not match:
        return None
    return ("-c" if match[1] in ("-c", "--constraint") else "-r"), match[2]


def read_requirements(path: Path, root: Path, seen: frozenset[Path] = frozenset()) -> list[str]:
    """pip's requirement lines of `path`, with `-r`/`-c` files of the project inlined (the build sees only
    this one file) and local paths refused (the build cannot reach them)."""
    if path.resolve() in seen:
        raise HostError(f"APP's requirements include {path} twice (an -r loop); remove one of the includes", code=2)
    lines: list[str] = []
    for number, raw in enumerate(_read_text(path, "requirements file").splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        include = _include(line)
        if include is not None:
            kind, target = include
            included = read_requirements(path.parent / target, root, seen | {path.resolve()})
            lines += [f"-c {item}" if kind == "-c" and not item.startswith("-") else item for item in included]
            continue
        if line.startswith(("-e", "--editable", ".", "/", "file:")) or "@ file:" in line:
            raise HostError(
                f"{path.name} line {number}: {line!r} is a local path, which the image build cannot reach; "
                "the project's own code is copied and importable already, other local packages go in as wheels (WHEELHOUSE)",
                code=2,
            )
        lines.append(line)
    return lines


def pyproject_dependencies(path: Path) -> list[str]:
    """[project] dependencies of a pyproject.toml (none when it has no [project] table)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise HostError("reading APP's pyproject.toml needs Python 3.11+ or the tomli package on the build host", code=2) from None
    try:
        data = tomllib.loads(_read_text(path, "pyproject.toml"))
    except tomllib.TOMLDecodeError as exc:
        raise HostError(f"APP's pyproject.toml is not valid TOML ({exc}); fix it", code=2) from None
    deps = data.get("project", {}).get("dependencies", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise HostError("APP's pyproject.toml [project] dependencies is not a list of strings; fix it", code=2)
    return list(deps)


def _ignore_patterns(folder: Path) -> tuple[list[str], list[str]]:
    """ALWAYS_EXCLUDED and the project's .dockerignore, as glob patterns; and its `!` lines, which put back only what
    SECRET_PATTERNS leaves out (a secret shipped on purpose)."""
    patterns, wanted = list(ALWAYS_EXCLUDED), []
    ignore = folder / ".dockerignore"
    if ignore.is_file():
        for raw in _read_text(ignore, ".dockerignore").splitlines():
            line = raw.strip()
            if line.startswith("!") and line[1:].strip():
                wanted.append(line[1:].strip().rstrip("/"))
            elif line and not line.startswith("#"):
                patterns.append(line.rstrip("/"))
    return patterns, wanted


def _excluded(relative: PurePosixPath, patterns: list[str]) -> bool:
    """A pattern with a slash or a leading / matches from the project's top; one without matches any name."""
    text = relative.as_posix()
    for pattern in patterns:
        if "/" in pattern.lstrip("/") or pattern.startswith("/"):
            if fnmatch.fnmatch(text, pattern.lstrip("/").replace("**/", "*")):
                return True
        elif fnmatch.fnmatch(relative.name, pattern):
            return True
    return False


def code_files(folder: Path, left_out: list[PurePosixPath] | None = None) -> list[PurePosixPath]:
    """Every regular file of the project that goes into the code layer, sorted; symlinks are followed
    only when they stay inside the project. Likely secrets (SECRET_PATTERNS) the project did not ask for by a `!`
    line go to `left_out` instead (a folder once)."""
    patterns, wanted = _ignore_patterns(folder)
    found: list[PurePosixPath] = []
    root = folder.resolve()

    def walk(directory: Path) -> None:
        for entry in sorted(directory.iterdir()):
            relative = PurePosixPath(entry.relative_to(folder).as_posix())
            if _excluded(relative, patterns):
                continue
            if _excluded(relative, list(SECRET_PATTERNS)) and not _excluded(relative, wanted):
                if left_out is not None:
                    left_out.append(relative)
                continue
            if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                continue
            if entry.is_dir():
                walk(entry)
            elif entry.is_file():
                found.append(relative)

    walk(folder)
    return found


def digest_of(folder: Path, files: list[PurePosixPath], requirements: list[str]) -> str:
    digest = hashlib.sha256()
    for relative in files:
        digest.update(relative.as_posix().encode() + b"\0" + (folder / relative).read_bytes() + b"\0")
    digest.update("\n".join(requirements).encode())
    return digest.hexdigest()[:12]


def git_revision(folder: Path) -> str:
    """The commit the project folder is at, `-dirty` when it has changes; "" outside a repository."""
    try:
        rev = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f"{rev}-dirty" if status.strip() else rev


def parse_command(text: str, folder: Path) -> tuple[str, ...]:
    try:
        command = tuple(shlex.split(text))
    except ValueError as exc:
        raise HostError(f"APP_CMD={text!r} is not a command line ({exc}); quote it as a shell would", code=2) from None
    index = python_script_index(command)
    script = command[index] if index is not None else None
    if script and not PurePosixPath(script).is_absolute() and not (folder / script).is_file():
        raise HostError(f"APP_CMD={text!r} runs {script}, which APP={folder} does not have; name a script of the project", code=2)
    return command


def read_app(folder: Path, command: str = "") -> App:
    """The project at `folder` as an App; every bad input is a one-line HostError (exit 2)."""
    if not folder.is_dir():
        raise HostError(f"APP={folder} is not a folder; point APP at your project (the folder with your training code)", code=2)
    requirements: list[str] = []
    source = ""
    if (folder / "requirements.txt").exists():
        requirements, source = read_requirements(folder / "requirements.txt", folder), "requirements.txt"
    elif (folder / "pyproject.toml").exists():
        requirements, source = pyproject_dependencies(folder / "pyproject.toml"), "pyproject.toml"
    left_out: list[PurePosixPath] = []
    files = code_files(folder, left_out)
    if not source and not any(f.suffix == ".py" for f in files):
        raise HostError(
            f"APP={folder} has neither a requirements file (requirements.txt, or dependencies in pyproject.toml) nor Python code; "
            "point APP at your project folder",
            code=2,
        )
    return App(
        name=folder.resolve().name,
        source=folder,
        requirements=tuple(requirements),
        requirements_from=source,
        files=tuple(files),
        left_out=tuple(left_out),
        digest=digest_of(folder, files, requirements),
        revision=git_revision(folder),
        command=parse_command(command, folder) if command.strip() else (),
    )


def check_torch_requirements(app: App, torch_version: str) -> None:
    """A direct requirement on torch (triton, nvidia-*) that the image's torch does not satisfy is refused
    before the build; what a dependency drags in is refused by the build's first step (docker/install-app.py)."""
    held = Version(torch_version)
    for line in app.requirements:
        if line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise HostError(f"APP's {app.requirements_from}: {line!r} is not a requirement pip can read ({exc}); fix it", code=2) from None
        if canonicalize_name(req.name) == "torch" and req.specifier and not req.specifier.contains(held, prereleases=True):
            raise HostError(
                f"APP's {app.requirements_from} asks for {line!r}, but the image's torch is {torch_version}; "
                f"remove the pin (the image provides torch) or build with TORCH_VERSION to match it",
                code=2,
            )
        if is_held(req.name) and canonicalize_name(req.name) != "torch" and req.specifier:
            print(f"images: APP asks for {line!r}; the image's own {req.name} stays (the build fails if they disagree)", flush=True)


def stage_app(app: App, context: Path) -> None:
    """The project into the build context: `app-deps/requirements.txt` (the dependency layer's only input)
    and `app/` (the code layer)."""
    deps, code = context / "app-deps", context / "app"
    for folder in (deps, code):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    (deps / "requirements.txt").write_text("".join(f"{line}\n" for line in app.requirements))
    for relative in app.files:
        target = code / relative
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        shutil.copy2(app.source / relative, target)
        # Readable by any uid, and runnable where it was runnable by its owner; folders 755 whatever the umask.
        target.chmod(target.stat().st_mode | 0o444 | (0o111 if target.stat().st_mode & 0o100 else 0))
    for folder in (code, *(code / r for r in {f.parent for f in app.files})):
        folder.chmod(0o755)


def build_args(app: App) -> dict[str, str]:
    """What the app's Dockerfile takes as build arguments (the code layer's record and labels)."""
    return {
        "APP_HELD": " ".join(HELD_PACKAGES),
        "APP_NAME": app.name,
        "APP_RECORD": json.dumps(app.record(), sort_keys=True),
        "APP_REVISION": app.revision or "none",
        "APP_DIGEST": app.digest,
        "APP_CMD": shlex.join(app.command),
    }


def left_out_note(app: App) -> str | None:
    """The build's one line on the likely secrets it left out of the image, and how to put one in on purpose."""
    if not app.left_out:
        return None
    names = [f"{path}/" if (app.source / path).is_dir() else str(path) for path in app.left_out]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"images: left out of the image as likely secrets: {shown}; to ship one on purpose, add a line !NAME "
        f"(e.g. !{names[0].rstrip('/')}) to {app.source / '.dockerignore'}"
    )


def describe(app: App) -> str:
    """One line for the build log."""
    count = len([r for r in app.requirements if not r.startswith("-")])
    deps = f"{count} requirements from {app.requirements_from}" if app.requirements_from else "no requirements"
    rev = f", git {app.revision[:12]}{'-dirty' if app.revision.endswith('-dirty') else ''}" if app.revision else ""
    cmd = f", runs {shlex.join(app.command)!r}" if app.command else ", default command: the bundled trainer"
    return f"app {app.name} from {app.source}: {len(app.files)} files, {deps}, digest {app.digest}{rev}{cmd}"
