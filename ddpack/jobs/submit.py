"""`ddpack submit`: from a project folder to a queued job, with a record of exactly what ran.

    settings (flags) -> checks (each problem one line, exit 2) -> the image (built only when its inputs changed)
      -> the squashfs in the shared images folder (converted only when the image changed; content-addressed,
         atomic, reused only when it is the user's own file) -> the run folder (run.json, the job script and the
         helpers it sources, logs/) -> sbatch -> the job appended to run.json

`--dry-run` stops before anything is built, written or queued: it prints the job script and runs the checks that
would otherwise fail hours later, in the queue or on the nodes (pyxis in srun, the squashfs there, the run folder
inside the container's mounts, the partition's size, the log folder writable, every setting).

The job script is one of the pyxis templates (enroot/pyxis-per-task.sbatch, enroot/pyxis-torchrun.sbatch) with the
run's #SBATCH options in place of the template's and its settings exported at the top, nothing inherited from the
submitting shell's DDPACK_* variables: the script in the run folder is the whole job, and `ddpack resubmit` sends
it again.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.job_side import module, node_helper, settings_table
from ddpack.jobs import slurm_cli
from ddpack.jobs.run_record import RunRecord, append_job, write_json_atomic, write_record
from ddpack.jobs.sweep import SWEEP_RECORD, placeholders, sweep_command, sweep_env, sweep_points, sweep_problems
from ddpack.private_files import not_yours_alone
from train import run_folder

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = {"per-task": "pyxis-per-task.sbatch", "torchrun": "pyxis-torchrun.sbatch"}
# The job's files beside its script (enroot/ddpack_job.py's docstring says what each holds).
HELPERS = ("ddpack-job.sh", "ddpack_job.py", "ddpack_node.py", "ddpack_records.py", "ddpack_settings.py", "ddpack_slurm.py", "ddpack_staging.py",
           "ddpack_training.py")  # fmt: skip
# Settings submit sets itself from its flags: --env may not set them behind the flags' back.
OWN_SETTINGS = ("DDPACK_SQSH", "DDPACK_RUN_DIR", "DDPACK_HOME", "DDPACK_MOUNTS", "DDPACK_COMMAND", "DDPACK_SPARE_NODES", "DDPACK_NPROC")
SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What the job takes from the submitting shell besides --secret's names (sbatch --export): the login basics and
# nothing else. NCCL_*, FI_*, CUDA_* and the rest of a login shell reach the job only when named (--env NAME).
LOGIN_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ")
# sbatch's options ddpack sets itself, and what to use instead of --sbatch-arg for each (long and short spellings).
OWNED_OPTIONS = {
    **dict.fromkeys(("--array", "-a"), "a sweep's points (--sweep)"),
    **dict.fromkeys(("--output", "-o", "--error", "-e", "--open-mode"), "the run folder's logs/"),
    **dict.fromkeys(("--export", "--export-file"), "--env and --secret"),
    **dict.fromkeys(("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node"), "--nodes, --spares and --tasks-per-node"),
    **dict.fromkeys(("--gpus-per-node", "--gpus", "-G"), "--gpus-per-node"),
    **dict.fromkeys(("--requeue", "--no-requeue", "--signal", "--no-kill", "-k", "--exclusive"), "the job's own restart and requeue"),
    **dict.fromkeys(("--job-name", "-J"), "--name"),
    **dict.fromkeys(("--partition", "-p"), "--partition"),
    **dict.fromkeys(("--time", "-t"), "--time"),
    **dict.fromkeys(("--account", "-A"), "--account"),
    **dict.fromkeys(("--qos", "-q"), "--qos"),
    **dict.fromkeys(("--constraint", "-C"), "--constraint"),
    **dict.fromkeys(("--reservation",), "--reservation"),
    **dict.fromkeys(("--dependency", "-d"), "--after RUN[:ok|any|notok]"),
    **dict.fromkeys(("--chdir", "-D", "--wrap", "--parsable", "--test-only", "--batch"), "submit itself"),
}
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, kw_only=True)
class SubmitSettings:
    """What one `ddpack submit` asks for, by keyword (the flags, resolved)."""

    app_dir: Path
    nodes: int
    tasks_per_node: int = 1
    spares: int = 0
    gpus_per_node: int = 0  # > 0: the CUDA image (Dockerfile.gpu), and Slurm's --gpus-per-node
    efa: bool = False  # with GPUs: the image carries AWS's EFA installer (libfabric, aws-ofi-nccl)
    partition: str | None = None
    time_limit: str | None = None
    template: str = "per-task"
    mounts: str = "/fsx:/fsx"
    runs: Path
    images: Path
    env: dict[str, str] = field(default_factory=dict)
    command: tuple[str, ...] = ()
    sqsh: Path | None = None  # a squashfs made already: nothing is built or converted
    name: str | None = None
    secrets: tuple[str, ...] = ()  # names only: Slurm hands their values from this shell to the job (sbatch --export)
    sweep: dict[str, list[str]] = field(default_factory=dict)  # NAME -> values: one job array of their cross product
    sweep_parallel: int | None = None  # at most this many of the sweep's points at once (the array's %)
    account: str | None = None  # Slurm's own: --account, --qos, --constraint, --reservation
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    sbatch_args: tuple[str, ...] = ()  # any other sbatch option (--sbatch-arg), none of those ddpack sets (OWNED_OPTIONS)
    after: str | None = None  # --after RUN[:ok|any|notok] as given, and Slurm's dependency it resolved to
    dependency: str | None = None  # afterok:<job>, afterany:<job>, afternotok:<job>
    tags: dict[str, str] = field(default_factory=dict)  # --tag KEY=VALUE: run.json's tags (ls --tag finds them)
    note: str | None = None  # --note: run.json's note

    @property
    def exported_names(self) -> tuple[str, ...]:
        """The names sbatch --export takes from this shell: the login basics and the secrets."""
        return (*LOGIN_ENV, *self.secrets)

    @property
    def variant(self) -> str:
        """The image the job needs: the CUDA one (nccl) when it asks for GPUs, else the CPU one (gloo)."""
        return "gpu" if self.gpus_per_node else "cpu"

    @property
    def job_name(self) -> str:
        return self.name or (self.sqsh.stem.split("+")[0] if self.sqsh else self.app_dir.resolve().name)


# --------------------------------------------------------------------------- settings


def setting_problems(settings: SubmitSettings) -> list[str]:
    """Each invalid setting, as one line naming it, its value and what is expected."""
    problems = []
    if settings.nodes < 1:
        problems.append(f"--nodes {settings.nodes}: a job needs at least 1 node")
    if settings.tasks_per_node < 1:
        problems.append(f"--tasks-per-node {settings.tasks_per_node}: each node runs at least 1 task")
    if settings.spares < 0 or settings.gpus_per_node < 0:
        problems.append("--spares and --gpus-per-node are whole numbers from 0")
    if settings.efa and not settings.gpus_per_node:
        problems.append("--efa adds AWS's EFA installer to the CUDA image: it needs --gpus-per-node")
    if settings.template not in TEMPLATES:
        problems.append(f"--template {settings.template}: expected one of {', '.join(TEMPLATES)}")
    if settings.time_limit is not None and not SLURM_TIME.fullmatch(settings.time_limit):
        problems.append(f"--time {settings.time_limit}: not a Slurm time (minutes, H:MM:SS, D-HH, D-HH:MM:SS)")
    for entry in settings.mounts.split(","):
        parts = entry.split(":")
        if not entry or len(parts) > 3 or not all(p.startswith("/") for p in parts[:2] if p):
            problems.append(f"--mounts {settings.mounts}: {entry!r} is not SRC[:DST[:FLAGS]] with absolute paths")
    table = settings_table().SETTINGS
    for name, value in settings.env.items():
        if not ENV_NAME.fullmatch(name):
            problems.append(f"--env {name}={value}: {name!r} is not a variable name")
        elif name in OWN_SETTINGS:
            problems.append(f"--env {name}: set by submit's own flags (--sqsh, --runs, --mounts, -- COMMAND, --spares, --tasks-per-node)")
        elif not name.startswith("DDPACK_"):
            continue
        elif name not in table:
            problems.append(f"--env {name}: not a ddpack setting (a typo?); docs/cluster.md lists them")
        elif table[name].own:
            problems.append(f"--env {name}: set by ddpack itself ({table[name].meaning}), not by you")
        else:  # a sweep's value with {NAME} in it: each point's value is checked
            points = enumerate(sweep_points(settings.sweep)) if per_point(settings, value) else ()
            every = [sweep_env({name: value}, point, i)[name] for i, point in points] or [value]
            why = next((why for one in dict.fromkeys(every) if (why := table[name].problem(name, one)) is not None), None)
            if why is not None:
                problems.append(f"--env {why}")
    for number, name in enumerate(settings.secrets, 1):
        if not ENV_NAME.fullmatch(name):  # `--secret TOKEN=value`, `--secret $TOKEN`: the text may be the value itself
            problems.append(
                f"--secret (the {ordinal(number)}): not a variable name, and not shown here as it may hold the value; "
                "export the value in this shell and give its NAME alone"
            )
        # ALL, NONE and NIL mean something else to sbatch --export (ALL: the whole shell): never a secret's name.
        elif name.startswith(("DDPACK_", "SLURM_")) or name in LOGIN_ENV or name.upper() in ("ALL", "NONE", "NIL"):
            problems.append(f"--secret {name}: not a variable name of your own (DDPACK_*, SLURM_* and {', '.join(LOGIN_ENV)} are not secrets)")
        elif name in settings.env:
            problems.append(f"--secret {name} is also an --env setting, whose value is written in the job script; give it once, as --secret")
        elif not os.environ.get(name):
            problems.append(f"--secret {name}: {name} is not set in this environment; export it here first (its value goes to no file)")
    if settings.sweep:
        problems.extend(sweep_problems(settings.command, settings.sweep, settings.env))
        if settings.sweep_parallel is not None and settings.sweep_parallel < 1:
            problems.append(f"--sweep-parallel {settings.sweep_parallel}: at least 1 point at a time")
    elif settings.sweep_parallel is not None:
        problems.append("--sweep-parallel limits a sweep's points at once: it needs --sweep NAME=V1,V2,...")
    problems.extend(slurm_option_problems(settings))
    if settings.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", settings.name):
        problems.append(f"--name {settings.name!r}: letters, digits, '.', '_' and '-' only (it names the job and the run folder)")
    elif settings.name is None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", settings.job_name):
        # Slurm expands %u, %j, ... in the log path the name is part of, and a space or '/' breaks the run folder's name.
        problems.append(
            f"the job's name {settings.job_name!r} (from {'--sqsh' if settings.sqsh else 'the project folder'}'s name) is not only letters, "
            "digits, '.', '_' and '-'; give --name"
        )
    return problems


def option_name(option: str) -> str:
    """An sbatch option's name as OWNED_OPTIONS spells it: --name of --name=value, -X of -Xvalue."""
    return option.split("=")[0].split()[0] if option.startswith("--") else option[:2]


def slurm_option_problems(settings: SubmitSettings) -> list[str]:
    """Slurm's own options, each checked as far as this host can (sbatch --test-only checks the rest)."""
    problems = []
    for flag, value in (("--account", settings.account), ("--qos", settings.qos), ("--reservation", settings.reservation)):
        if value is not None and not SLURM_NAME.fullmatch(value):
            problems.append(f"{flag} {value!r}: not a Slurm name (letters, digits, '.', '_' and '-')")
    if settings.constraint is not None and (not settings.constraint or re.search(r"[\s\x00-\x1f\x7f]", settings.constraint)):
        problems.append(f"--constraint {settings.constraint!r}: node features without spaces, such as a100&ib or [rack1|rack2]")
    for option in settings.sbatch_args:
        if not re.fullmatch(r"--?[A-Za-z][^\x00-\x1f\x7f\"]*", option) or (" " in option.partition("=")[0]):
            problems.append(f"--sbatch-arg {option!r}: an sbatch option (--mem=0, --comment=x), one a flag, on one line, without a double quote")
        elif option_name(option) in OWNED_OPTIONS:
            problems.append(f"--sbatch-arg {option}: ddpack sets {option_name(option)} itself; use {OWNED_OPTIONS[option_name(option)]}")
    return problems


# --------------------------------------------------------------------------- the image and its squashfs


@dataclass(frozen=True, kw_only=True)
class ImageChoice:
    ref: str
    image_id: str
    bundle: str
    built: bool
    ecr_digests: tuple[str, ...] = ()
    variant: str = "cpu"
    efa: bool = False


def ordinal(number: int) -> str:
    return f"{number}{'th' if 10 <= number % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th')}"


def secrets_in_accounting() -> bool:
    """Whether Slurm's accounting database keeps every job's environment (AccountingStoreFlags=job_env in `scontrol
    show config`), where a --secret's value then lies too; False where scontrol does not answer."""
    answer = slurm_cli.ask(["scontrol", "show", "config"], timeout=10)
    found = re.search(r"^AccountingStoreFlags\s*=\s*(.*)$", answer.stdout, re.MULTILINE)
    return not answer.failed and found is not None and "job_env" in found.group(1).split(",")


def source_digest(*, variant: str = "cpu", efa: bool = False) -> str:
    """The bundle's build inputs (what images.stage_context copies, less the wheelhouse), its variant and torch's
    version: the bundle's image is built again only when this changes."""
    from ddpack.images.images import CONTEXT_ITEMS, DEFAULT_TORCH_VERSION

    torch_version = os.environ.get("TORCH_VERSION") or DEFAULT_TORCH_VERSION
    digest = hashlib.sha256(f"{variant}{' efa' if efa else ''} {torch_version}".encode())
    for item in CONTEXT_ITEMS:
        path = ROOT / item
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) if path.is_dir() else [path]
        for file in files:
            digest.update(file.relative_to(ROOT).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def local_image(client: Any, ref: str) -> Any | None:
    from docker.errors import ImageNotFound

    try:
        return client.images.get(ref)
    except ImageNotFound:
        return None


def ensure_image(app_dir: Path, *, build: bool = True, variant: str = "cpu", efa: bool = False) -> ImageChoice | None:
    """The project's image on the bundle's `variant` (cpu, or gpu: the CUDA image, with AWS's EFA installer when `efa`):
    found by the digest of its inputs (the project's files and requirements, the bundle's sources), built only when no
    image has them. None in a dry run that would build."""
    from ddpack.images.app import read_app
    from ddpack.images.engine import docker_client
    from ddpack.images.images import build_app_image, build_image, plan_build

    app = read_app(app_dir)
    client = docker_client()
    bundle_ref = f"ddpack:src-{source_digest(variant=variant, efa=efa)}"
    bundle = local_image(client, bundle_ref)
    ref = f"{app.name.lower()}:{app.digest}-{bundle.id.split(':')[-1][:12] if bundle else 'new'}"
    image = local_image(client, ref) if bundle else None
    chosen = {"bundle": bundle_ref, "variant": variant, "efa": efa}
    if image is not None:
        return ImageChoice(ref=ref, image_id=image.id, built=False, ecr_digests=tuple(image.attrs.get("RepoDigests") or ()), **chosen)
    if not build:
        return None
    if bundle is None:
        extra = ("--build-arg", "INSTALL_EFA=1") if efa else ()
        build_image(plan_build(variant=variant, tag=bundle_ref, version=bundle_ref.split(":")[1], extra_args=extra))
        bundle = client.images.get(bundle_ref)
        ref = f"{app.name.lower()}:{app.digest}-{bundle.id.split(':')[-1][:12]}"
    image_id = build_app_image(plan_build(variant=variant, tag=ref, app=app, bundle_tag=bundle_ref))
    return ImageChoice(ref=ref, image_id=image_id, built=True, **chosen)


def squashfs_name(images: Path, app_name: str, image_id: str) -> Path:
    """The content-addressed name in the shared images folder; a name another user holds (or a file that is not
    plainly ours) is never reused or replaced: this user's own name beside it instead."""
    path = images / f"{app_name.lower()}-{image_id.split(':')[-1][:16]}.sqsh"
    if not os.path.lexists(path) or not_yours_alone(path) is None:
        return path
    return path.with_name(f"{path.stem}-u{os.geteuid()}.sqsh")


def squashfs_holds(path: Path, image: ImageChoice) -> bool:
    """Whether `path` is this user's own squashfs of `image`, made with today's options: reused, not converted again."""
    from ddpack.images.sqsh import DEFAULT_SQUASH_OPTIONS, holds, squash_options

    return not_yours_alone(path) is None and holds(path, image.image_id, squash_options(DEFAULT_SQUASH_OPTIONS)[0])


def ensure_squashfs(image: ImageChoice, images: Path, app_name: str) -> tuple[Path, bool]:
    """(the squashfs, whether it was converted now): reused when it is ours and its record names this image."""
    from ddpack.images.sqsh import convert

    if not images.is_dir():
        raise HostError(f"--images {images} is not a folder; create it on the shared filesystem (mkdir -p {images})", code=2)
    path = squashfs_name(images, app_name, image.image_id)
    if squashfs_holds(path, image):
        return path, False
    convert(image.ref, path)
    return path, True


# --------------------------------------------------------------------------- the job script


def per_point(settings: SubmitSettings, value: str) -> bool:
    """Whether an --env value differs from point to point: a sweep's, with a {NAME} in it."""
    return bool(settings.sweep) and bool(placeholders([value]))


def sbatch_directive(option: str) -> str:
    """An --sbatch-arg as an #SBATCH line takes it: a value with a space in double quotes (sbatch reads an unquoted
    second word as a directive of its own, and refuses it)."""
    name, sep, value = option.partition("=")
    return f'{name}="{value}"' if sep and re.search(r"\s", value) else option


def slurm_options(settings: SubmitSettings) -> dict[str, str | None]:
    """Slurm's own options the user gave by name (sbatch's spelling without its dashes)."""
    return {"account": settings.account, "qos": settings.qos, "constraint": settings.constraint, "reservation": settings.reservation,
            "dependency": settings.dependency}  # fmt: skip


def sbatch_lines(settings: SubmitSettings, run_dir: Path) -> list[str]:
    """The job's #SBATCH options; a sweep's array writes each point's log in that point's run folder (`%a`)."""
    per_node = 1 if settings.template == "torchrun" else settings.tasks_per_node
    count = len(sweep_points(settings.sweep)) if settings.sweep else 0
    limit = f"%{settings.sweep_parallel}" if settings.sweep_parallel else ""
    log = run_dir / "%a" / run_folder.LOGS / run_folder.job_log("%A_%a") if count else run_dir / run_folder.LOGS / run_folder.job_log("%j")
    lines = [
        f"--job-name={settings.job_name}",
        f"--nodes={settings.nodes + settings.spares}",
        f"--ntasks-per-node={per_node}",
        *([f"--gpus-per-node={settings.gpus_per_node}"] if settings.gpus_per_node else []),
        *([f"--partition={settings.partition}"] if settings.partition else []),
        *([f"--time={settings.time_limit}"] if settings.time_limit else []),
        *([f"--array=0-{count - 1}{limit}"] if count else []),
        *(f"--{key}={value}" for key, value in slurm_options(settings).items() if value),
        "--exclusive",
        f"--output={log}",
        "--open-mode=append",
        "--signal=USR1@90",
        "--requeue",
        "--no-kill",
        *(sbatch_directive(option) for option in settings.sbatch_args),
    ]
    return [f"#SBATCH {line}" for line in lines]


def exported(settings: SubmitSettings, run_dir: Path, sqsh: Path) -> dict[str, str]:
    """The settings the job script exports; a sweep's script sets DDPACK_RUN_DIR and DDPACK_COMMAND a point
    (sweep_block), its settings otherwise the same for every point."""
    values = {
        "DDPACK_HOME": str(run_dir / run_folder.JOB),
        "DDPACK_RUN_DIR": str(run_dir),
        "DDPACK_SQSH": str(sqsh),
        "DDPACK_MOUNTS": settings.mounts,
    }
    if settings.sweep:
        del values["DDPACK_RUN_DIR"]
    elif settings.command:  # a JSON list: every word reaches every rank's exec exactly as given (ddpack_words)
        values["DDPACK_COMMAND"] = json.dumps(list(settings.command))
    if settings.spares:
        values["DDPACK_SPARE_NODES"] = str(settings.spares)
    if settings.template == "torchrun":
        values["DDPACK_NPROC"] = str(settings.tasks_per_node)
    return {**values, **{name: value for name, value in settings.env.items() if not per_point(settings, value)}}


def sweep_block(settings: SubmitSettings, sweep_dir: Path) -> list[str]:
    """A sweep's script: each array task picks its point's run folder and command (a JSON list, as DDPACK_COMMAND is)."""
    every = sweep_points(settings.sweep)
    return [
        f"# A sweep of {len(every)} points, one a task of the array: the point's run folder and command.",
        f'ddpack_point=${{SLURM_ARRAY_TASK_ID:?"this script is a sweep of {len(every)} points: sbatch --array=0-{len(every) - 1} it"}}',
        "ddpack_commands=(",
        # Each command a JSON list in single quotes; the comment is the point as JSON (no newline can end it early).
        *(f"    {shlex.quote(json.dumps(sweep_command(settings.command, point, i)))}  # {json.dumps(point)}" for i, point in enumerate(every)),
        ")",
        *per_point_env(settings, every),
        f"export DDPACK_RUN_DIR={shlex.quote(str(sweep_dir))}/${{ddpack_point}}",
        'export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"',
    ]


def per_point_env(settings: SubmitSettings, every: list[dict[str, str]]) -> list[str]:
    """Each --env value with a {NAME} in it, one a point (an array a variable, picked by the array task)."""
    lines = []
    for number, (name, value) in enumerate(item for item in settings.env.items() if per_point(settings, item[1])):
        values = [sweep_env({name: value}, point, i)[name] for i, point in enumerate(every)]
        lines += [f"ddpack_env_{number}=({' '.join(shlex.quote(v) for v in values)})", f'export {name}="${{ddpack_env_{number}[ddpack_point]}}"']
    return lines


def render_script(settings: SubmitSettings, run_dir: Path, sqsh: Path) -> str:
    """The template with this run's #SBATCH options and settings: the whole job, as submitted."""
    template = (ROOT / "enroot" / TEMPLATES[settings.template]).read_text()
    head, marker, body = template.partition("set -uo pipefail\n")
    if not marker:
        raise HostError(f"enroot/{TEMPLATES[settings.template]} has no 'set -uo pipefail' line to put the settings after", code=1)
    comments = [line for line in head.splitlines() if not line.lstrip("#").startswith("SBATCH")]
    settings_block = [
        "# ddpack submit: this run's settings (run.json records them). None is inherited from the submitting shell.",
        "for ddpack_var in $(compgen -e | grep '^DDPACK_'); do unset \"${ddpack_var}\"; done",
        "unset SLURM_EXPORT_ENV  # sbatch --export named what the job takes from the shell; every step gets all of this script's",
        *(f"export {name}={shlex.quote(value)}" for name, value in exported(settings, run_dir, sqsh).items()),
        *(sweep_block(settings, run_dir) if settings.sweep else []),
    ]
    return "\n".join([comments[0], *sbatch_lines(settings, run_dir), *comments[1:], marker.rstrip("\n"), *settings_block, ""]) + body


# --------------------------------------------------------------------------- checks before anything queues


def container_path(path: Path, mounts: str) -> str | None:
    """`path` as the container sees it through pyxis' --container-mounts, None when no mount holds it: the job's own
    rule (enroot/ddpack_job.py), so that submit's check and the job's answer never disagree."""
    return module("ddpack_job").container_path(str(path), mounts)


def writable_folder(folder: Path) -> str | None:
    """Why `folder` (made when missing) cannot hold this run's files, or None: tried for real, with a file of our
    own that is removed again (permissions, read-only filesystems and ACLs all answer)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".ddpack-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{existing} is not writable ({exc.strerror})"
    return None


def shared_folder_problem(folder: Path, flag: str) -> str | None:
    """Why `folder` (the runs or images folder, often on a shared filesystem) could be swapped or filled by another
    user under this user's runs and images, or None: it and every folder above it must be root's or this user's, and
    sticky where others can write (the job helper's own rule, enroot/ddpack_node.py)."""
    node = node_helper()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        node.check_ancestors(existing / "x")
    except node.Refused as why:
        return f"{flag} {folder}: {why}; use a folder of your own ({flag} {folder}/{getpass.getuser()})"
    return None


def cluster_problems(settings: SubmitSettings, sqsh: Path | None, run_dir: Path) -> list[str]:
    """What would fail in the queue or on the nodes, each as one line."""
    problems = []
    pyxis = slurm_cli.pyxis_answer()
    if pyxis:
        problems.append(pyxis)
    if sqsh is not None and not (sqsh.is_file() and os.access(sqsh, os.R_OK)):
        problems.append(
            f"the squashfs {sqsh} is not a readable file here; the nodes would not find it either (--sqsh, or --images on the shared filesystem)"
        )
    if container_path(run_dir, settings.mounts) is None:
        problems.append(
            f"the run folder {run_dir} is under none of --mounts {settings.mounts}: the container could not write its snapshots; "
            "add its filesystem to --mounts or choose --runs under one"
        )
    partition = slurm_cli.partition_nodes(settings.partition, settings.gpus_per_node)
    wanted = settings.nodes + settings.spares
    if isinstance(partition, str):
        problems.append(partition)
    elif partition[1] < wanted:
        name, usable, other = partition
        asked = f"--nodes {settings.nodes} + --spares {settings.spares}"
        kind = f"nodes with {settings.gpus_per_node} GPUs" if settings.gpus_per_node else "nodes"
        besides = f" (and {other} down, drained, not responding{' or with fewer GPUs' if settings.gpus_per_node else ''})" if other else ""
        problems.append(
            f"partition {name} has {usable} {kind} that can run a job{besides} and the job asks for {wanted} ({asked}); "
            "it would wait until enough come back: ask for fewer, or another --partition"
        )
    for folder, flag in ((settings.runs, "--runs"), *([(settings.images, "--images")] if settings.sqsh is None else [])):
        if (problem := shared_folder_problem(folder, flag)) is not None:
            problems.append(problem)
    why = writable_folder(run_dir / run_folder.LOGS)
    if why:
        problems.append(f"the log folder {run_dir / run_folder.LOGS} cannot be written: {why}; choose --runs where you may write")
    return problems


def slurm_problems(script: str) -> list[str]:
    """What Slurm's controller says of the exact job script (`sbatch --test-only`: its options, partition, nodes, GRES
    and time limit, against the cluster as it is now), as one line; nothing is queued."""
    with tempfile.NamedTemporaryFile("w", prefix="ddpack-test-only-", suffix=".sbatch") as handle:
        handle.write(script)
        handle.flush()
        answer = slurm_cli.ask(["sbatch", "--test-only", handle.name], timeout=60)
    said = [line.strip() for line in answer.stderr.splitlines() if line.strip()]
    if not answer.failed or not said:  # accepted, or the controller did not answer: sbatch itself asks it again
        return []
    return [f"sbatch --test-only refused this job: {said[-1]}; fix the option it names"]


def raise_problems(problems: list[str]) -> None:
    """Each problem on its own line, then exit 2 (HostError prints the last; the others first)."""
    if not problems:
        return
    for problem in problems[:-1]:
        print(f"ddpack submit: error: {problem}", file=sys.stderr, flush=True)
    raise HostError(problems[-1], code=2)


# --------------------------------------------------------------------------- the record of the code


def git(app_dir: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(app_dir), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_record(app_dir: Path, run_dir: Path | None) -> dict[str, Any]:
    """Which code: the project's digest (every file that went into the image), its git commit, and the uncommitted
    diff (kept in the run folder as code.diff, hashed here) and untracked files, which the image holds too."""
    from ddpack.images.app import read_app

    app = read_app(app_dir)
    if (git(app_dir, "rev-parse", "--is-inside-work-tree") or "").strip() != "true":
        # No commit to name: the digest of every file that went into the image is the record of the code.
        return {"app_dir": str(app_dir.resolve()), "digest": app.digest, "files": len(app.files), "vcs": "not under git",
                "git_commit": None, "git_dirty": None, "diff_sha256": None, "diff_file": None, "untracked": []}  # fmt: skip
    commit = (git(app_dir, "rev-parse", "HEAD") or "").strip()
    diff = (git(app_dir, "diff", "HEAD", "--binary", "--", ".") or "") if commit else ""
    untracked = (git(app_dir, "ls-files", "--others", "--exclude-standard", "--", ".") or "").split()
    record = {
        "app_dir": str(app_dir.resolve()),
        "digest": app.digest,
        "files": len(app.files),
        "vcs": "git" if commit else "git, no commit yet",
        "git_commit": commit or None,
        "git_dirty": bool(diff or untracked) if commit else None,
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "diff_file": "code.diff" if diff else None,
        "untracked": untracked,
    }
    if diff and run_dir is not None:
        (run_dir / "code.diff").write_text(diff)
    return record


# --------------------------------------------------------------------------- submit


def new_run_dir(runs: Path, name: str) -> Path:
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.mkdtemp(prefix=f"{name}-{stamp}-", dir=runs))


def write_job(run_dir: Path, script: str) -> Path:
    """The job script and the helpers it sources, copied into the run folder: what ran stays with the run."""
    job = run_dir / run_folder.JOB
    job.mkdir()
    for helper in HELPERS:
        shutil.copy2(ROOT / "enroot" / helper, job / helper)
    path = job / run_folder.JOB_SCRIPT
    path.write_text(script)
    path.chmod(0o700)
    (run_dir / run_folder.LOGS).mkdir()
    return path


@dataclass(frozen=True, kw_only=True)
class Submitted:
    job_id: str | None
    run_dir: str
    sqsh: str
    image: str | None
    built: bool
    converted: bool
    script: str

    def next_commands(self) -> list[str]:
        return [f"ddpack status {self.run_dir} --watch", f"ddpack logs {self.run_dir} -f", f"ddpack cancel {self.run_dir}"]


def submit(settings: SubmitSettings, *, dry_run: bool = False, say: Any = print, run_file: dict[str, Any] | None = None) -> Submitted:
    raise_problems(setting_problems(settings))
    # What submit writes (the run folder, run.json, the squashfs) and the job log sbatch opens are as private as the
    # job's own files (the templates' DDPACK_UMASK); the caller's umask is its own again afterwards.
    previous = os.umask(int(settings.env.get("DDPACK_UMASK", "077"), 8))
    try:
        return _submit(settings, dry_run=dry_run, say=say, run_file=run_file)
    finally:
        os.umask(previous)


def _submit(settings: SubmitSettings, *, dry_run: bool, say: Any, run_file: dict[str, Any] | None) -> Submitted:
    # Every check that needs no image runs before anything is built: a typo costs seconds, not a build.
    planned_dir = (settings.runs / f"{settings.job_name}-<time>").resolve()
    planned_sqsh = settings.sqsh.resolve() if settings.sqsh is not None else settings.images / f"{settings.job_name.lower()}-<image id>.sqsh"
    problems = cluster_problems(settings, planned_sqsh if settings.sqsh is not None else None, planned_dir)
    if not problems:
        problems = slurm_problems(render_script(settings, planned_dir, planned_sqsh))
    if problems and not dry_run:
        raise_problems(problems)
    image: ImageChoice | None = None
    converted = False
    sqsh = planned_sqsh
    if settings.sqsh is None:
        try:
            image = ensure_image(settings.app_dir, build=not dry_run, variant=settings.variant, efa=settings.efa)
        except HostError as why:  # no engine, a bad project: a dry run names it with the rest
            if not dry_run:
                raise
            problems.append(str(why))
            image = None
        if image is None:
            bundle = f"ddpack:src-{source_digest(variant=settings.variant, efa=settings.efa)}"
            say(f"submit: would build {settings.app_dir.resolve().name} on the bundle's {settings.variant} image ({bundle}) and convert it to {sqsh}")
        else:
            say(f"submit: image {image.ref} ({image.image_id[:19]}{', built now' if image.built else ', unchanged: not rebuilt'})")
            if dry_run:
                sqsh = squashfs_name(settings.images, settings.job_name, image.image_id)
                made = squashfs_holds(sqsh, image)
                say(f"submit: squashfs {sqsh} ({'already holds it' if made else 'would convert the image to it'})")
            else:
                sqsh, converted = ensure_squashfs(image, settings.images, settings.job_name)
                say(f"submit: squashfs {sqsh} ({'converted now' if converted else 'already holds it: not copied'})")
    if dry_run:
        if settings.sweep:
            count, at_once = len(sweep_points(settings.sweep)), settings.sweep_parallel
            say(f"submit: a sweep of {count} points, one job array{f' (at most {at_once} at once)' if at_once else ''}, one run folder a point")
        print(render_script(settings, planned_dir, sqsh), end="")
        raise_problems(problems)
        say("submit: dry run: every check passed (sbatch --test-only too); nothing was queued")
        return Submitted(
            job_id=None, run_dir=str(planned_dir), sqsh=str(sqsh), image=image.ref if image else None, built=False, converted=False, script=""
        )
    if settings.secrets and secrets_in_accounting():
        say(
            f"submit: warning: this cluster stores each job's environment in its accounting database (AccountingStoreFlags=job_env), "
            f"so the values of {', '.join(settings.secrets)} go there as well as to the controller's state (docs/security.md)"
        )
    run_dir = None
    try:
        run_dir = new_run_dir(settings.runs, settings.job_name).resolve()
        script = render_script(settings, run_dir, sqsh)
        script_path = write_job(run_dir, script)
    except OSError as why:  # a full or read-only filesystem, a quota: no run folder is left without its run.json
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        where = f"cannot write the run folder under {settings.runs} ({why.strerror or why})"
        raise HostError(f"{where}; make room there or give --runs, then submit again", code=1) from None
    made = RecordParts(
        image=asdict(image) if image else {"ref": None, "image_id": None, "note": "--sqsh: made outside ddpack submit"},
        sqsh=sqsh,
        code=code_record(settings.app_dir, run_dir) if settings.sqsh is None else {"app_dir": None, "note": "--sqsh given"},
        script_path=script_path,
        script_sha256=hashlib.sha256(script.encode()).hexdigest(),
        versions=slurm_cli.versions(),
        run_file=run_file,
    )
    if settings.sweep:
        return submit_sweep(settings, run_dir, made, say=say, image=image, converted=converted)
    try:
        write_record(made.record(settings, run_dir, run_dir.name))
    except OSError as why:
        shutil.rmtree(run_dir, ignore_errors=True)
        where = f"cannot write {run_dir / run_folder.RUN_RECORD} ({why.strerror or why})"
        raise HostError(f"{where}; make room under {settings.runs} or give --runs, then submit again", code=1) from None
    job_id = slurm_cli.sbatch(script_path, run_dir, export=settings.exported_names)
    record_job(run_dir, job_id, "submit")
    say(f"submit: job {job_id} queued; run folder {run_dir} (run.json records the image, code, command and settings)")
    return Submitted(
        job_id=job_id,
        run_dir=str(run_dir),
        sqsh=str(sqsh),
        image=image.ref if image else None,
        built=bool(image and image.built),
        converted=converted,
        script=str(script_path),
    )


@dataclass(frozen=True, kw_only=True)
class RecordParts:
    """What every run.json of one submission shares (a sweep's points too): the image, squashfs, code, script."""

    image: dict[str, Any]
    sqsh: Path
    code: dict[str, Any]
    script_path: Path
    script_sha256: str
    versions: dict[str, str]
    run_file: dict[str, Any] | None

    def record(self, settings: SubmitSettings, run_dir: Path, name: str, sweep: dict[str, Any] | None = None) -> RunRecord:
        info = self.sqsh.stat()
        script_env = {**exported(settings, run_dir, self.sqsh), "DDPACK_HOME": str(self.script_path.parent)}
        return RunRecord(
            name=name,
            run_dir=str(run_dir),
            created=time.time(),
            user=getpass.getuser(),
            host=socket.gethostname(),
            image=self.image,
            sqsh={"path": str(self.sqsh), "key": image_key(self.sqsh), "size": info.st_size, "mtime_ns": info.st_mtime_ns},
            code=self.code,
            command=list(settings.command),
            settings={
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items() if k not in ("tags", "note")},
                "exported": script_env,
            },
            script=os.path.relpath(self.script_path, run_dir),
            script_sha256=self.script_sha256,
            versions=self.versions,
            environment=job_environment(settings, script_env),
            run_file=self.run_file,
            sweep=sweep,
            tags=dict(settings.tags),
            note=settings.note,
        )


def submit_sweep(settings: SubmitSettings, sweep_dir: Path, made: RecordParts, *, say: Any, image: Any, converted: bool) -> Submitted:
    """One job array for the sweep's points: a run folder a point (its own run.json: its command and values), then
    sweep.json naming them all and the array's job id, which each point records as `<array>_<index>`."""
    every = sweep_points(settings.sweep)
    points = []
    for index, point in enumerate(every):
        point_dir = sweep_dir / str(index)
        (point_dir / run_folder.LOGS).mkdir(parents=True)
        alone = replace(settings, command=tuple(sweep_command(settings.command, point, index)), env=sweep_env(settings.env, point, index),
                        sweep={}, sweep_parallel=None)  # fmt: skip
        where = {"dir": str(sweep_dir), "index": index, "values": point, "points": len(every)}
        write_record(made.record(alone, point_dir, f"{sweep_dir.name}/{index}", sweep=where))
        points.append(point)
    record = {
        "format": 1, "name": sweep_dir.name, "created": time.time(), "values": settings.sweep, "names": list(settings.sweep), "points": points,
        "parallel": settings.sweep_parallel, "script": os.path.relpath(made.script_path, sweep_dir), "job_id": None,
        "run_file": made.run_file, "tags": dict(settings.tags), "note": settings.note,
    }  # fmt: skip
    write_json_atomic(sweep_dir / SWEEP_RECORD, record)
    job_id = slurm_cli.sbatch(made.script_path, sweep_dir, export=settings.exported_names)
    try:  # the array first: with it in sweep.json, cancel SWEEP reaches every point whatever fails after
        write_json_atomic(sweep_dir / SWEEP_RECORD, {**record, "job_id": job_id})
    except OSError as exc:
        raise HostError(f"job array {job_id} is queued, but recording it in {sweep_dir}/{SWEEP_RECORD} failed ({exc}); scancel {job_id}", code=1) from None
    for index in range(len(every)):
        record_job(sweep_dir / str(index), f"{job_id}_{index}", "submit")
    at_once = f", at most {settings.sweep_parallel} at once" if settings.sweep_parallel else ""
    say(f"submit: job array {job_id} queued: {len(every)} points{at_once}; sweep folder {sweep_dir} (a run folder a point: 0/ to {len(every) - 1}/)")
    return Submitted(
        job_id=job_id,
        run_dir=str(sweep_dir),
        sqsh=str(made.sqsh),
        image=image.ref if image else None,
        built=bool(image and image.built),
        converted=converted,
        script=str(made.script_path),
    )


def job_environment(settings: SubmitSettings, script_env: dict[str, str]) -> dict[str, Any]:
    """The environment the job gets, for run.json: the job script's settings, the login basics from this shell with
    their values, and the secrets by name only."""
    return {
        "script": script_env,
        "login_shell": {name: os.environ[name] for name in LOGIN_ENV if name in os.environ},
        "secrets": list(settings.secrets),
    }


def record_job(run_dir: Path, job_id: str, how: str, changes: dict[str, Any] | None = None) -> None:
    """The queued job into run.json; a failure here is one line that names the job, which is queued all the same."""
    try:
        append_job(run_dir, job_id, how, changes)
    except (OSError, HostError) as exc:
        raise HostError(f"job {job_id} is queued, but recording it in {run_dir}/run.json failed ({exc}); scancel {job_id} or add it by hand", code=1) from None


def image_key(sqsh: Path) -> str:
    """The staging key the job helper derives for this squashfs: the same image gives the same key."""
    return module("ddpack_staging").image_key(sqsh)


def as_json(result: Submitted) -> str:
    return json.dumps({**asdict(result), "next": result.next_commands()}, indent=2)
