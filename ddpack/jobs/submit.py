"""`ddpack submit`: from a project folder to a queued job, with a record of exactly what ran.

    settings (flags) -> checks (each problem one line, exit 2) -> the image (built only when its inputs changed)
      -> the squashfs in the shared images folder (converted only when the image changed; content-addressed,
         atomic, reused only when it is the user's own file) -> the run folder (run.json, the job script and the
         helpers it sources, logs/) -> sbatch -> the job appended to run.json

`--dry-run` stops before anything is built, written or queued: it prints the job script and runs the checks that
would otherwise fail hours later, in the queue or on the nodes (submit_checks.py). The job script is rendered by
job_script.py; the record is run_json.py's.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.job_side import module, setting_value
from ddpack.jobs import slurm_cli
from ddpack.jobs.job_script import exported, render_script, write_job
from ddpack.jobs.run_json import RunRecord, append_job, write_json_atomic, write_record
from ddpack.jobs.submit_checks import (
    LOGIN_ENV,
    SubmitSettings,
    cluster_problems,
    point_share,
    raise_problems,
    recovery_plan,
    secrets_in_accounting,
    setting_problems,
    slurm_problems,
)
from ddpack.jobs.sweep_points import SWEEP_RECORD
from ddpack.private_files import not_yours_alone
from train import run_folder

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- settings


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


# --------------------------------------------------------------------------- checks before anything queues


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
    if not settings.sweep:  # {{NAME}} is the text {NAME} in every command, as in a sweep's (no {NAME} is left: refused above)
        settings = settings.one_point(0)
    # What submit writes (the run folder, run.json, the squashfs) and the job log sbatch opens are as private as the
    # job's own files (the templates' DDPACK_UMASK); the caller's umask is its own again afterwards.
    previous = os.umask(int(setting_value("DDPACK_UMASK", settings.env), 8))
    try:
        return _submit(settings, dry_run=dry_run, say=say, run_file=run_file)
    finally:
        os.umask(previous)


def _submit(settings: SubmitSettings, *, dry_run: bool, say: Any, run_file: dict[str, Any] | None) -> Submitted:
    if settings.sweep:  # whole nodes, or a share of them: decided once from the partition's nodes, said, and recorded
        share, why = point_share(settings, slurm_cli.node_size(settings.partition, settings.gpus_per_node))
        settings = replace(settings, share=share)
        say(f"submit: {why}")
    # Every check that needs no image runs before anything is built: a typo costs seconds, not a build.
    planned_dir = (settings.runs / f"{settings.job_name}-<time>").resolve()
    planned_sqsh = (
        settings.sqsh.resolve() if settings.sqsh is not None else settings.images / f"{settings.job_name.lower()}-<image id>.sqsh"
    )
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
            say(
                f"submit: would build {settings.app_dir.resolve().name} on the bundle's {settings.variant} image ({bundle}) and convert it to {sqsh}"
            )
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
            count, at_once = len(settings.points), settings.sweep_parallel
            say(
                f"submit: a sweep of {count} points, one job array{f' (at most {at_once} at once)' if at_once else ''}, one run folder a point"
            )
        print(render_script(settings, planned_dir, sqsh), end="")
        for line in recovery_lines(settings):
            say(f"submit: {line}")
        if (plan := preflight_plan(settings)) is not None:
            say(plan)
        raise_problems(problems)
        say("submit: dry run: every check passed (sbatch --test-only too); nothing was queued")
        return Submitted(
            job_id=None,
            run_dir=str(planned_dir),
            sqsh=str(sqsh),
            image=image.ref if image else None,
            built=False,
            converted=False,
            script="",
        )
    for line in recovery_lines(settings):
        say(f"submit: {line}")
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


def recovery_lines(settings: SubmitSettings) -> list[str]:
    """What the run does when a rank dies, and why (the dry run shows it before anything is queued); what its spare
    nodes are for."""
    plan = recovery_plan(settings)
    lines = [f"recovery: {plan.line()}"]
    if plan.standbys and settings.gpus_per_node:
        lines.append(
            "recovery: in-process recovery on NCCL has not yet run across two GPUs (docs/recovery.md): a restart is the proven path"
        )
    if settings.spares and plan.on_spares:
        lines.append(
            f"spares: {settings.spares} node(s) held back; they host the standbys ({settings.tasks_per_node} a spare), which take a "
            "lost node's ranks in process; where recovery cannot, a restart in place swaps a spare in"
        )
    elif settings.spares:
        lines.append(
            f"spares: {settings.spares} node(s) held back for a restart in place after a node fails; they host no standbys ({plan.why})"
        )
    return lines


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
                "recovery": recovery_plan(settings).fields(),
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
    every = settings.points
    points = []
    for index, point in enumerate(every):
        point_dir = sweep_dir / str(index)
        (point_dir / run_folder.LOGS).mkdir(parents=True)
        alone = settings.one_point(index)
        where = {"dir": str(sweep_dir), "index": index, "values": point, "points": len(every)}
        write_record(made.record(alone, point_dir, f"{sweep_dir.name}/{index}", sweep=where))
        points.append(point)
    record = {
        "format": 1, "name": sweep_dir.name, "created": time.time(), "values": settings.sweep, "names": list(settings.sweep), "points": points,
        "parallel": settings.sweep_parallel, "script": os.path.relpath(made.script_path, sweep_dir), "job_id": None,
        "run_file": made.run_file, "tags": dict(settings.tags), "note": settings.note,
        **({"search": settings.sweep_search} if settings.sweep_search else {}),
    }  # fmt: skip
    write_json_atomic(sweep_dir / SWEEP_RECORD, record)
    job_id = slurm_cli.sbatch(made.script_path, sweep_dir, export=settings.exported_names)
    try:  # the array first: with it in sweep.json, cancel SWEEP reaches every point whatever fails after
        write_json_atomic(sweep_dir / SWEEP_RECORD, {**record, "job_id": job_id})
    except OSError as exc:
        raise HostError(
            f"job array {job_id} is queued, but recording it in {sweep_dir}/{SWEEP_RECORD} failed ({exc}); scancel {job_id}", code=1
        ) from None
    for index in range(len(every)):
        record_job(sweep_dir / str(index), f"{job_id}_{index}", "submit")
    at_once = f", at most {settings.sweep_parallel} at once" if settings.sweep_parallel else ""
    say(
        f"submit: job array {job_id} queued: {len(every)} points{at_once}; sweep folder {sweep_dir} (a run folder a point: 0/ to {len(every) - 1}/)"
    )
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
        raise HostError(
            f"job {job_id} is queued, but recording it in {run_dir}/run.json failed ({exc}); scancel {job_id} or add it by hand", code=1
        ) from None


def image_key(sqsh: Path) -> str:
    """The staging key the job helper derives for this squashfs: the same image gives the same key."""
    return module("ddpack_staging").image_key(sqsh)


def preflight_plan(settings: SubmitSettings) -> str | None:
    """What the job does with a node that fails the preflight (`--env DDPACK_PREFLIGHT=1`), said by the dry run: with
    no spare it ends, naming the node; with spares it swaps the failing nodes out and trains on the others
    (enroot/ddpack_job.py's preflight verb). None when the job runs no preflight before training."""
    if settings.env.get("DDPACK_PREFLIGHT") != "1":
        return None
    first = f"submit: the preflight checks all {settings.nodes + settings.spares} nodes before training"
    if not settings.spares:
        return f"{first}; a node that fails it ends the job there, named in its log and record (no spare: --spares 0)"
    return (
        f"{first}; up to {settings.spares} node(s) that fail only its node checks are swapped for the spares and the job trains "
        "on the others; more, or any other failure, end the job there, naming them"
    )


def as_json(result: Submitted) -> str:
    return json.dumps({**asdict(result), "next": result.next_commands()}, indent=2)
