"""`ddpack try`: one point of a sweep (or the plain command) run here, before it waits in the queue.

    ddpack try [APP_DIR] [submit's options] [--index I] [--timeout S] [--lines N] [--dry-run] [--json] [-- COMMAND...]

It takes submit's arguments (its parser is submit's parent: the same options, the same run file, the same checks) and
runs what the job's rank 0 would run, in a one-task world, with `docker run`: the image submit would build (or the one
`--sqsh`'s record names: the Docker image the squashfs was made from), `entrypoint` with the job's words after it
(`-- COMMAND`, else the bundled trainer's DDPACK_TRAIN_ARGS, else nothing: the image's own command), the settings the job
script exports (the point's command and `--env` values, DDPACK_*), the run folder's defaults the templates set
(DDPACK_SNAPSHOT_DIR, DDPACK_METRICS_FILE, DDPACK_FORENSICS_DIR, DDPACK_PROJECT_DIR) for a scratch run folder of its own,
the rendezvous of a one-task world (RANK 0 of WORLD_SIZE 1 on 127.0.0.1), `--mounts` as bind mounts, and the job's
user, host network and host IPC (as pyxis runs a container). It prints the first lines, then the exit status; the whole
output stays in the scratch folder's try.log.

Exit: 0 the command ended 0; 6 it failed (as a FAILED job: its own status is printed); 4 it still ran at --timeout and
was stopped (as a TIMEOUT); 2 bad input (no image, no such point, no docker command); 1 ddpack (or Docker) failed.
A mount whose source this host lacks is left out, with a warning line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ddpack.errors import HostError
from ddpack.job_side import settings_table
from ddpack.jobs.slurm_cli import EXIT_FOR_STATE
from ddpack.jobs.submit_checks import SubmitSettings, raise_problems, setting_problems
from ddpack.jobs.sweep_points import point_label
from train import run_folder

STOP_GRACE_S = 10  # docker stop's wait between SIGTERM and SIGKILL: the trainer's stop at a step boundary
SCRATCH_PREFIX = "ddpack-try-"
LOG = "try.log"
# One task's rendezvous: the world the entrypoint resolves from them (entrypoint/plan.py's env mode) is rank 0 alone.
ONE_TASK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
DOCKER_FAILED = 125  # docker run's own failure (the image, a mount, the engine), never the command's


@dataclass(frozen=True, kw_only=True)
class TryRun:
    """What `ddpack try` runs: the docker command (values of the environment in `env`, never in argv, where `ps` shows
    them to other users), the container's name (docker stop's), the image, the scratch run folder and the point."""

    argv: tuple[str, ...]
    name: str
    env: dict[str, str]
    image: str
    scratch: Path
    index: int | None
    points: int
    label: str

    def shown(self) -> str:
        """The command as one shell line that runs it: the environment's values, then docker run naming them."""
        return shlex.join(["env", *(f"{name}={value}" for name, value in self.env.items()), *self.argv])


@dataclass(frozen=True, kw_only=True)
class Outcome:
    exit: int | None  # the command's exit status; None: stopped at --timeout
    seconds: float
    first: list[str]
    last: list[str]  # the lines after the first, up to --lines of them (the end: a traceback's)
    count: int


def pick_point(settings: SubmitSettings, index: int | None) -> tuple[SubmitSettings, int | None, str]:
    """(the point's settings as a run of its own, its index or None for a plain run, a label for people)."""
    if not settings.sweep:
        if index not in (None, 0):
            raise HostError(
                f"--index {index} picks a point of a sweep, and there is no sweep (--sweep, --point, --points, --sample)", code=2
            )
        return settings.one_point(0), None, "the command"
    points = settings.points
    index = 0 if index is None else index
    if not 0 <= index < len(points):
        raise HostError(f"--index {index}: the sweep has points 0 to {len(points) - 1}", code=2)
    return settings.one_point(index), index, f"point {index} of {len(points)} ({point_label(points[index])})"


def step_words(settings: SubmitSettings) -> list[str]:
    """What the training step runs after `entrypoint` (the job's `words COMMAND`): `--` and your program, else the
    bundled trainer's flags (DDPACK_TRAIN_ARGS), else nothing (the image's own command, or the bundled trainer)."""
    if settings.command:  # with DDPACK_TRAIN_ARGS too: refused by setting_problems, as submit refuses it
        return ["--", *settings.command]
    return settings_table().command_words(settings.env.get("DDPACK_TRAIN_ARGS", ""))


def bind_mounts(mounts: str) -> tuple[list[str], list[str]]:
    """pyxis' --container-mounts (SRC[:DST[:FLAGS]],...) as docker's --mount options, and the sources this host lacks
    (left out: a build machine rarely has the cluster's /fsx; `-v` would make an empty folder there as root)."""
    found, missing = [], []
    for entry in filter(None, mounts.split(",")):
        src, _, rest = entry.partition(":")
        dst, _, flags = rest.partition(":")
        if not os.path.exists(src):
            missing.append(src)
            continue
        readonly = ",readonly" if "ro" in flags.split("+") else ""  # pyxis joins a mount's flags with +
        found += ["--mount", f"type=bind,source={src},target={dst or src}{readonly}"]
    return found, missing


def container_env(settings: SubmitSettings, scratch: Path, sqsh: Path | None) -> dict[str, str]:
    """The environment the job's rank 0 gets, for a run folder `scratch` (seen at its own path): the settings the job
    script exports (job_script.exported: the point's --env values among them), then what the template sets for the
    step (ddpack-job.sh's ddpack_command and ddpack_project_dir), then one task's rendezvous. No standbys (one task)."""
    from ddpack.jobs.job_script import exported

    table = settings_table()
    env = exported(settings, scratch, sqsh or Path(f"{scratch}/no.sqsh"))
    if sqsh is None:
        del env["DDPACK_SQSH"]
    given = env.get("DDPACK_PROJECT_DIR")  # else the submission folder: a ddpack submit's job is submitted from its run folder
    inside = table.container_path(given, settings.mounts) if given else str(scratch)
    env.update(
        {
            "DDPACK_STANDBYS": "0",
            "DDPACK_SNAPSHOT_DIR": f"{scratch}/{run_folder.SNAPSHOTS}",
            "DDPACK_METRICS_FILE": f"{scratch}/{run_folder.METRICS}",
            "DDPACK_FORENSICS_DIR": f"{scratch}/{run_folder.FORENSICS}",
            **ONE_TASK,
            "MASTER_PORT": str(free_port()),  # the host's network, as the job's: a port no other try holds
        }
    )
    if inside is None:
        env.pop("DDPACK_PROJECT_DIR", None)
    else:
        env["DDPACK_PROJECT_DIR"] = inside
    return env


def free_port() -> int:
    """A port free on this host now (the kernel's choice), for the rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def docker_argv(
    docker: str, image: str, settings: SubmitSettings, scratch: Path, env: dict[str, str], name: str, mounts: list[str]
) -> tuple[str, ...]:
    """`docker run` as pyxis runs the job's container: the user's uid, the host's network and IPC (/dev/shm), the mounts,
    the run folder as the working directory, `entrypoint` (pyxis runs no image ENTRYPOINT: the templates name it), and
    each variable by name alone (its value from this process's environment: `env`'s, and a --secret's from this shell,
    which `env` does not hold, so that neither the dry run nor --json prints it)."""
    gpus = ["--gpus", "1"] if settings.gpus_per_node else []  # one task: one GPU, as the per-task template gives a rank
    return (
        docker, "run", "--rm", "--name", name, "--label", "io.ddpack.try=1", "--user", f"{os.getuid()}:{os.getgid()}",
        "--network", "host", "--ipc", "host", *gpus, *mounts,
        "--mount", f"type=bind,source={scratch},target={scratch}", "--workdir", str(scratch),
        *(word for variable in [*env, *settings.secrets] for word in ("-e", variable)), "--entrypoint", "entrypoint", image,
        *step_words(settings),
    )  # fmt: skip


def image_of_sqsh(sqsh: Path) -> tuple[str, str]:
    """(the image's name, its id) that make sqsh's record beside `sqsh` names: the Docker image the squashfs was made from."""
    from ddpack.images.sqsh import record_path

    record = record_path(sqsh)
    if not sqsh.is_file():
        raise HostError(f"--sqsh {sqsh} is not a file; give the squashfs make sqsh wrote", code=2)
    try:
        data = json.loads(record.read_text())
        image, image_id, size = str(data.get("image") or ""), str(data["image_id"]), int(data["size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise HostError(
            f"--sqsh {sqsh} has no readable record of its image ({record.name}, which make sqsh writes beside it), so try cannot tell "
            "which Docker image it holds; give the squashfs make sqsh wrote (build/NAME+TAG.sqsh), or leave --sqsh out to use the project's image",
            code=2,
        ) from None
    if size != sqsh.stat().st_size:
        raise HostError(
            f"--sqsh {sqsh}: its record {record.name} is of another file ({size} bytes, not {sqsh.stat().st_size}); make sqsh again", code=2
        )
    return image, image_id


def choose_image(settings: SubmitSettings, *, dry_run: bool) -> tuple[str, str]:
    """(the image to run, a line for people): --sqsh's (its record's image id, held by this host's engine), else the
    project's image as submit finds it, built when its inputs changed (not in a dry run)."""
    from ddpack.images.engine import docker_client
    from ddpack.jobs.submit import ensure_image, source_digest

    if settings.sqsh is not None:
        name, image_id = image_of_sqsh(settings.sqsh)
        if not dry_run:
            from docker.errors import ImageNotFound

            try:
                docker_client().images.get(image_id)
            except ImageNotFound:
                raise HostError(
                    f"--sqsh {settings.sqsh} was made from {name or 'an image'} ({image_id[:19]}), which this host's Docker engine does "
                    "not hold; try it where it was built (make image), or leave --sqsh out to build the project's image here",
                    code=2,
                ) from None
        return image_id, f"image {name or '?'} ({image_id[:19]}), the one {settings.sqsh} was made from"
    image = ensure_image(settings.app_dir, build=not dry_run, variant=settings.variant, efa=settings.efa)
    if image is None:
        bundle = f"ddpack:src-{source_digest(variant=settings.variant, efa=settings.efa)}"
        project = settings.app_dir.resolve().name
        raise HostError(
            f"no image of {project} is built yet, and a dry run builds nothing: ddpack try without --dry-run builds it (on {bundle})",
            code=2,
        )
    return image.ref, f"image {image.ref} ({image.image_id[:19]}{', built now' if image.built else ''})"


def plan_try(opts: argparse.Namespace, settings: SubmitSettings, docker: str) -> tuple[TryRun, str]:
    """The run, and the image's line for people; the scratch folder is made only for a run (a dry run names its pattern)."""
    raise_problems(setting_problems(settings))
    alone, index, label = pick_point(settings, opts.index)
    if opts.timeout <= 0:
        raise HostError(f"--timeout {opts.timeout:g}: expected seconds > 0", code=2)
    if opts.lines < 0:
        raise HostError(f"--lines {opts.lines}: expected a whole number from 0", code=2)
    mounts, missing = bind_mounts(alone.mounts)
    for src in missing:
        print(
            f"ddpack try: warning: {src} (--mounts) does not exist here: not mounted; a program that reads it fails here", file=sys.stderr
        )
    image, said = choose_image(alone, dry_run=opts.dry_run)
    base = Path(tempfile.gettempdir())
    scratch = (
        base / f"{SCRATCH_PREFIX}{alone.job_name}-XXXXXXXX"
        if opts.dry_run
        else Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{alone.job_name}-", dir=base))
    )
    env = container_env(alone, scratch, alone.sqsh.resolve() if alone.sqsh else None)
    name = f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:12]}"
    argv = docker_argv(docker, image, alone, scratch, env, name, mounts)
    points = len(settings.points) if settings.sweep else 1
    return TryRun(argv=argv, name=name, env=env, image=image, scratch=scratch, index=index, points=points, label=label), said


def run_container(run: TryRun, *, timeout_s: float, lines: int, out: TextIO | None) -> Outcome:
    """docker run, its output kept in the scratch folder's try.log and its first `lines` printed to `out` as they come
    (None: printed nowhere); stopped (docker stop) at `timeout_s`, and on Ctrl-C."""
    first: list[str] = []
    last: collections.deque[str] = collections.deque(maxlen=lines)
    count = 0
    started = time.monotonic()
    with open(run.scratch / LOG, "wb") as log:
        try:
            child = subprocess.Popen(run.argv, env={**os.environ, **run.env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        except OSError as why:
            raise HostError(f"cannot run {run.argv[0]} ({why.strerror or why})", code=1) from None

        def read() -> None:
            nonlocal count
            assert child.stdout is not None
            for raw in child.stdout:
                log.write(raw)
                line = raw.decode(errors="replace").rstrip("\n")
                count += 1
                if count <= lines:
                    first.append(line)
                    if out is not None:
                        print(f"  {line}", file=out, flush=True)
                else:
                    last.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code: int | None = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(run.argv[0], run.name)
            child.wait()
            code = None
        except KeyboardInterrupt:
            stop(run.argv[0], run.name)
            child.wait()
            raise
        reader.join(timeout=STOP_GRACE_S)
    return Outcome(exit=code, seconds=time.monotonic() - started, first=first, last=list(last), count=count)


def stop(docker: str, name: str) -> None:
    """The container stopped as Slurm ends a job: SIGTERM, then SIGKILL after STOP_GRACE_S."""
    subprocess.run([docker, "stop", "--time", str(STOP_GRACE_S), name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def exit_for(outcome: Outcome) -> int:
    """try's exit status: 0 it ended 0, 4 stopped at --timeout (a TIMEOUT's), 6 it failed (a FAILED job's)."""
    if outcome.exit is None:
        return EXIT_FOR_STATE["TIMEOUT"]
    return EXIT_FOR_STATE["COMPLETED"] if outcome.exit == 0 else EXIT_FOR_STATE["FAILED"]


def ended_line(outcome: Outcome, run: TryRun, timeout_s: float) -> str:
    more = outcome.count - len(outcome.first)
    whole = f"; all {outcome.count} lines in {run.scratch / LOG}" if more > 0 else ""
    if outcome.exit is None:
        return f"try: still running after {timeout_s:g} s (--timeout): stopped (docker stop), exit 4{whole}"
    if outcome.exit == 0:
        return f"try: exit 0 after {outcome.seconds:.1f} s: the command ran to its end{whole}"
    return f"try: exit {outcome.exit} after {outcome.seconds:.1f} s: the command failed, exit 6{whole}"


def try_point(opts: argparse.Namespace, settings: SubmitSettings) -> int:
    """The verb: the point's run planned, then printed (--dry-run) or run here."""
    docker = shutil.which("docker")
    if docker is None and not opts.dry_run:
        raise HostError(
            "no docker command here; try runs the job's image with docker run: install Docker, or try on the machine that builds your images",
            code=2,
        )
    run, said = plan_try(opts, settings, docker or "docker")
    head = f"try: {said}; {run.label}, one task (RANK 0 of WORLD_SIZE 1), at most {opts.timeout:g} s; run folder {run.scratch}"
    if opts.dry_run:
        if opts.json:
            print(json.dumps({"image": run.image, "index": run.index, "points": run.points, "argv": list(run.argv), "env": run.env,
                              "command": run.shown()}, indent=2))  # fmt: skip
        else:
            print(head)
            print(run.shown())
        return 0
    if not opts.json:
        print(head, flush=True)
    outcome = run_container(run, timeout_s=opts.timeout, lines=opts.lines, out=None if opts.json else sys.stdout)
    if outcome.exit == DOCKER_FAILED:
        raise HostError(f"docker run could not start the container: {(outcome.last or outcome.first or ['no message'])[-1]}", code=1)
    if opts.json:
        print(json.dumps(to_json(run, outcome), indent=2))
        return exit_for(outcome)
    if outcome.exit not in (0, None) and outcome.last:
        print(f"try: its last {len(outcome.last)} lines:")
        print("\n".join(f"  {line}" for line in outcome.last))
    print(ended_line(outcome, run, opts.timeout))
    return exit_for(outcome)


def to_json(run: TryRun, outcome: Outcome) -> dict[str, Any]:
    return {"image": run.image, "index": run.index, "points": run.points, "argv": list(run.argv), "run_dir": str(run.scratch),
            "log": str(run.scratch / LOG), "exit": outcome.exit, "timed_out": outcome.exit is None, "seconds": round(outcome.seconds, 3),
            "lines": outcome.count, "first_lines": outcome.first, "last_lines": outcome.last}  # fmt: skip
