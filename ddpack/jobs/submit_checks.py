"""`ddpack submit`'s settings and every check it runs before a job is queued: each problem one line (exit 2), found
now rather than hours later in the queue or on the nodes (the flags and settings, Slurm's own options, the secrets'
accounting, pyxis in srun, the squashfs and the run folder inside the container's mounts, the partition's size, the
log folder writable, `sbatch --test-only` on the script itself).
"""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.job_side import module, node_helper, setting_value, settings_table
from ddpack.jobs import slurm_cli
from ddpack.jobs.sweep_points import placeholders, sweep_command, sweep_env, sweep_points, sweep_problems
from train import run_folder

# Settings submit sets itself from its flags: --env may not set them behind the flags' back (each with its flag).
OWN_SETTINGS = {
    "DDPACK_SQSH": "--sqsh",
    "DDPACK_RUN_DIR": "--runs",
    "DDPACK_HOME": "--runs (its run folder's job/)",
    "DDPACK_MOUNTS": "--mounts",
    "DDPACK_COMMAND": "-- COMMAND",
    "DDPACK_SPARE_NODES": "--spares",
    "DDPACK_NPROC": "--tasks-per-node",
    "DDPACK_STANDBYS": "--standbys",
}


SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
class NodeShare:
    """What a sweep's point asks of each node against what the partition's smallest node has: a point that asks less
    shares nodes as Slurm places it (no --exclusive), and the ledger charges it `fraction` of each node's hours."""

    cpus: int  # a node's: its tasks times --cpus-per-task
    gpus: int  # a node's: --gpus-per-node, or --gpus-per-task times its tasks
    node_cpus: int
    node_gpus: int

    @property
    def fraction(self) -> float:
        """Its GPUs over the node's where it asks GPUs, else its CPUs over the node's: the node's share it holds."""
        return self.gpus / self.node_gpus if self.gpus and self.node_gpus else self.cpus / self.node_cpus


def sbatch_count(options: tuple[str, ...], long: str, short: str | None = None) -> int | None:
    """A count an --sbatch-arg gives (`--cpus-per-task=4`, `-c4`, `-c 4`), the last one; None when not given."""
    found = None
    for option in options:
        name, _, value = option.partition("=") if option.startswith("--") else (option[:2], "", option[2:].strip())
        if name == long or (short and name == short):
            found = int(value) if value.strip().isdigit() else found
    return found


def asked_of_a_node(settings: SubmitSettings) -> tuple[int, int]:
    """(CPUs, GPUs) the job asks of each of its nodes: Slurm gives a task one CPU unless --cpus-per-task says more."""
    tasks = settings.tasks_per_node
    cpus = tasks * (sbatch_count(settings.sbatch_args, "--cpus-per-task", "-c") or 1)
    gpus_per_task = sbatch_count(settings.sbatch_args, "--gpus-per-task")
    return cpus, settings.gpus_per_node or tasks * (gpus_per_task or 0)


def point_share(settings: SubmitSettings, node: tuple[int, int] | None) -> tuple[NodeShare | None, str]:
    """Whether a sweep's points share nodes (a NodeShare) or take whole ones (None), and why, in words for the dry
    run: a point shares when it asks fewer CPUs and fewer GPUs than the partition's smallest node has. A plain run,
    torchrun's template (a node's ranks in one task of one CPU) and a partition sinfo does not size take whole nodes."""
    if not settings.sweep:
        return None, "a run takes whole nodes (--exclusive)"
    if settings.template == "torchrun":
        return None, "torchrun starts a node's ranks in one Slurm task, which Slurm would give one CPU: whole nodes (--exclusive)"
    if node is None:
        return None, "sinfo gave no node size for the partition: whole nodes (--exclusive)"
    cpus, gpus = asked_of_a_node(settings)
    asks = f"each point asks {cpus} CPU(s) and {gpus} GPU(s) of a node with {node[0]} CPUs and {node[1]} GPUs"
    if cpus >= node[0] or (gpus and gpus >= node[1]):
        return None, f"{asks}: whole nodes (--exclusive)"
    share = NodeShare(cpus=cpus, gpus=gpus, node_cpus=node[0], node_gpus=node[1])
    return (
        share,
        f"{asks}: the points share nodes as Slurm places them (not --exclusive), each charged {share.fraction:.3g} of a node's hours",
    )


@dataclass(frozen=True, kw_only=True)
class SubmitSettings:
    """What one `ddpack submit` asks for, by keyword (the flags, resolved)."""

    app_dir: Path
    nodes: int
    tasks_per_node: int = 1
    spares: int = 0
    standbys: int | None = None  # warm standby processes of the bundled trainer (None: the settings table's default, auto)
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
    sweep_listed: tuple[dict[str, str], ...] = ()  # the points themselves (--point, --points, --sample), else sweep's product
    sweep_search: dict[str, Any] | None = None  # how the points were made (search.sweep_space), kept in sweep.json
    account: str | None = None  # Slurm's own: --account, --qos, --constraint, --reservation
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    sbatch_args: tuple[str, ...] = ()  # any other sbatch option (--sbatch-arg), none of those ddpack sets (OWNED_OPTIONS)
    after: str | None = None  # --after RUN[:ok|any|notok] as given, and Slurm's dependency it resolved to
    dependency: str | None = None  # afterok:<job>, afterany:<job>, afternotok:<job>
    tags: dict[str, str] = field(default_factory=dict)  # --tag KEY=VALUE: run.json's tags (ls --tag finds them)
    note: str | None = None  # --note: run.json's note
    share: NodeShare | None = None  # a sweep's point that asks less than a whole node: not --exclusive (point_share)

    @property
    def points(self) -> list[dict[str, str]]:
        """The sweep's points: those listed or drawn, else the product of the --sweep values, in order."""
        return [dict(point) for point in self.sweep_listed] if self.sweep_listed else sweep_points(self.sweep)

    def one_point(self, index: int) -> SubmitSettings:
        """What the sweep's point `index` runs, as a run of its own (its command and --env values with the point's values
        in place, no sweep left): submit's record of each point and `ddpack try`'s run. Not a sweep: the command with
        each `{{NAME}}` as the text `{NAME}` (no `{NAME}` is left: setting_problems refuses it)."""
        if not self.sweep:
            return replace(self, command=tuple(sweep_command(self.command, {}, 0)))
        point = self.points[index]
        return replace(self, command=tuple(sweep_command(self.command, point, index)), env=sweep_env(self.env, point, index), sweep={},
                       sweep_parallel=None, sweep_listed=(), sweep_search=None)  # fmt: skip

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
    if settings.command and settings.env.get("DDPACK_TRAIN_ARGS"):  # the job refuses the pair at its start (ddpack_job.py words)
        problems.append("--env DDPACK_TRAIN_ARGS is for the bundled trainer, and -- COMMAND runs your own program; give one of them")
    table = settings_table().SETTINGS
    for name, value in settings.env.items():
        if not ENV_NAME.fullmatch(name):
            problems.append(f"--env {name}={value}: {name!r} is not a variable name")
        elif name in OWN_SETTINGS:
            problems.append(f"--env {name}: set by submit's own flag {OWN_SETTINGS[name]}; give that instead")
        elif not name.startswith("DDPACK_"):
            continue
        elif name not in table:
            problems.append(f"--env {name}: not a ddpack setting (a typo?); docs/cluster.md lists them")
        elif table[name].own:
            problems.append(f"--env {name}: set by ddpack itself ({table[name].meaning}), not by you")
        else:  # a sweep's value with {NAME} in it: each point's value is checked
            points = enumerate(settings.points) if per_point(settings, value) else ()
            every = [sweep_env({name: value}, point, i)[name] for i, point in points] or [value]
            why = next((why for one in dict.fromkeys(every) if (why := table[name].problem(name, one)) is not None), None)
            if why is not None:
                problems.append(f"--env {why}")
    if settings.standbys is not None and settings.standbys < 0:
        problems.append(f"--standbys {settings.standbys}: a whole number from 0")
    elif settings.standbys and (settings.command or settings.template != "per-task"):
        problems.append(
            f"--standbys {settings.standbys}: standbys are tasks of the bundled trainer's per-task step (docs/recovery.md); "
            + (
                "-- COMMAND runs your own program"
                if settings.command
                else f"--template {settings.template} starts a node's ranks with torchrun"
            )
        )
    for number, name in enumerate(settings.secrets, 1):
        if not ENV_NAME.fullmatch(name):  # `--secret TOKEN=value`, `--secret $TOKEN`: the text may be the value itself
            problems.append(
                f"--secret (the {ordinal(number)}): not a variable name, and not shown here as it may hold the value; "
                "export the value in this shell and give its NAME alone"
            )
        # ALL, NONE and NIL mean something else to sbatch --export (ALL: the whole shell): never a secret's name.
        elif name.startswith(("DDPACK_", "SLURM_")) or name in LOGIN_ENV or name.upper() in ("ALL", "NONE", "NIL"):
            problems.append(
                f"--secret {name}: not a variable name of your own (DDPACK_*, SLURM_* and {', '.join(LOGIN_ENV)} are not secrets)"
            )
        elif name in settings.env:
            problems.append(
                f"--secret {name} is also an --env setting, whose value is written in the job script; give it once, as --secret"
            )
        elif not os.environ.get(name):
            problems.append(f"--secret {name}: {name} is not set in this environment; export it here first (its value goes to no file)")
    if settings.sweep:
        problems.extend(sweep_problems(settings.command, settings.sweep, settings.env))
        if settings.sweep_parallel is not None and settings.sweep_parallel < 1:
            problems.append(f"--sweep-parallel {settings.sweep_parallel}: at least 1 point at a time")
    else:
        if settings.sweep_parallel is not None:
            problems.append("--sweep-parallel limits a sweep's points at once: it needs --sweep NAME=V1,V2,...")
        # {lr} with no sweep would reach the program as the text {lr}: a sweep whose --sweep was forgotten
        for name in sorted(placeholders(list(settings.command))):
            problems.append(f"the command uses {{{name}}}, but there is no sweep: add --sweep {name}=V1,V2,..., "
                            f"or write {{{{{name}}}}} for the text {{{name}}}")  # fmt: skip
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
            problems.append(
                f"--sbatch-arg {option!r}: an sbatch option (--mem=0, --comment=x), one a flag, on one line, without a double quote"
            )
        elif option_name(option) in OWNED_OPTIONS:
            problems.append(f"--sbatch-arg {option}: ddpack sets {option_name(option)} itself; use {OWNED_OPTIONS[option_name(option)]}")
    return problems


def ordinal(number: int) -> str:
    return f"{number}{'th' if 10 <= number % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th')}"


def secrets_in_accounting() -> bool:
    """Whether Slurm's accounting database keeps every job's environment (AccountingStoreFlags=job_env in `scontrol
    show config`), where a --secret's value then lies too; False where scontrol does not answer."""
    answer = slurm_cli.ask(["scontrol", "show", "config"], timeout=10)
    found = re.search(r"^AccountingStoreFlags\s*=\s*(.*)$", answer.stdout, re.MULTILINE)
    return not answer.failed and found is not None and "job_env" in found.group(1).split(",")


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


def recovery_plan(settings: SubmitSettings) -> Any:
    """Which recovery the run's training step has, and why (enroot/ddpack_settings.py `recovery`, the rule the job's
    program applies too): --standbys as given, else the table's default from what the job asks for (its GPUs) and what
    its tasks run (-- COMMAND, the torchrun template, the trainer's flags, or the image's own command: an image submit
    builds has none, a --sqsh's is named by make sqsh's record beside it)."""
    table = settings_table()
    given = setting_value("DDPACK_STANDBYS") if settings.standbys is None else str(settings.standbys)
    if settings.sqsh is None:
        image: str | None = ""
    else:
        image = module("ddpack_staging").image_command(str(settings.sqsh))
    has_words = bool(settings.env.get("DDPACK_TRAIN_ARGS", "").strip().strip("[]").strip())
    program = table.step_program(
        command=bool(settings.command), train_args=has_words, torchrun=settings.template != "per-task", image_command=image
    )
    return table.recovery(given, gpus=settings.gpus_per_node, program=program, spares=settings.spares, per_node=settings.tasks_per_node)


def cluster_problems(settings: SubmitSettings, sqsh: Path | None, run_dir: Path) -> list[str]:
    """What would fail in the queue or on the nodes, each as one line."""
    problems = []
    if settings.standbys and settings.sqsh is not None and not settings.env.get("DDPACK_TRAIN_ARGS"):
        command = module("ddpack_staging").image_command(str(settings.sqsh))
        if command:  # the entrypoint in each task would refuse it, on the nodes
            problems.append(
                f"--standbys {settings.standbys}: the image in {settings.sqsh} runs its own command ({command}), and standbys are tasks "
                "of the bundled trainer; give the trainer's flags (--env DDPACK_TRAIN_ARGS=...) or leave --standbys out"
            )
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


TEMPLATES = {"per-task": "pyxis-per-task.sbatch", "torchrun": "pyxis-torchrun.sbatch"}


def per_point(settings: SubmitSettings, value: str) -> bool:
    """Whether an --env value differs from point to point: a sweep's, with a {NAME} in it."""
    return bool(settings.sweep) and bool(placeholders([value]))


def container_path(path: Path, mounts: str) -> str | None:
    """`path` as the container sees it through pyxis' --container-mounts, None when no mount holds it: the job's own
    rule (enroot/ddpack_settings.py), so that submit's check and the job's answer never disagree."""
    return settings_table().container_path(str(path), mounts)


# What the job takes from the submitting shell besides --secret's names (sbatch --export): the login basics and
# nothing else. NCCL_*, FI_*, CUDA_* and the rest of a login shell reach the job only when named (--env NAME).
LOGIN_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ")
