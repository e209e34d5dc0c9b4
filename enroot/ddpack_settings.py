"""ddpack's job settings: the one table of every DDPACK_* name a job reads, with its pattern, default and meaning.

`ddpack submit` checks `--env` against it, and every template checks the job's environment against it first thing
(`ddpack_setup` runs `python3 -I -S ddpack_settings.py check`), so a value is refused by both or by neither, before
anything runs. It is the one place a default is written: the templates read them (`ddpack_settings.py defaults`, which
ddpack-job.sh evaluates), the job's program and the host through `value` (tests/test_settings.py holds it so).
docs/cluster.md lists the same names (a test holds it to this table). Standard library only: it runs with the nodes'
system Python, outside any image.

A pattern of None takes any text (a path, a command's words). Settings marked `own` are set by ddpack itself (the
templates, `ddpack submit`, the images): a user's `--env` may not set them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

WHOLE = r"\d+"
POSITIVE = r"[1-9]\d*"
SECONDS = r"\d+(\.\d+)?"
GRACE = r"0\.\d*[1-9]\d*|[1-9]\d{0,2}(\.\d+)?|[12]\d{3}(\.\d+)?|3[0-5]\d{2}(\.\d+)?|3600(\.0+)?"  # (0, 3600]


@dataclass(frozen=True)
class Setting:
    pattern: str | None  # a full match; None: any text
    default: str  # as the job sees it unset ("" when it has none)
    meaning: str
    own: bool = False  # set by ddpack (submit, the templates, the image), not by --env
    words: bool = False  # a command's words: whitespace-split, or a JSON list of strings when it starts with [

    def problem(self, name: str, value: str) -> str | None:
        """Why `value` is no value of this setting, in one line's words, or None."""
        if self.words and value.startswith("["):
            try:
                words = json.loads(value)
            except ValueError as why:
                return f"{name} starts with [ but is not a JSON list ({why}); write a JSON list of strings, or words without a leading ["
            if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
                return f"{name} is JSON but not a list of strings; write each argument as a string"
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return f"{name}={value}: expected {self.pattern.replace('|', ', ')}"
        return None


SETTINGS: dict[str, Setting] = {
    # What runs, and where.
    "DDPACK_SQSH": Setting(None, "/fsx/images/ddpack.sqsh", "the squashfs pyxis runs (a path on the shared filesystem)"),
    "DDPACK_IMAGE": Setting(None, "", "docker-hostnet.sbatch: the Docker image every node runs"),
    "DDPACK_RUN_DIR": Setting(None, "", "the run folder to continue (default: a new runs/<name>-<job> in the submission folder)"),
    "DDPACK_PROJECT_DIR": Setting(None, "", "where --task modules are found (default: the submission folder)"),
    "DDPACK_MOUNTS": Setting(None, "/fsx:/fsx", "pyxis' --container-mounts (host:container[:flags], comma-separated)"),
    "DDPACK_VENV": Setting(None, "", "baremetal.sbatch: the bundle's virtual environment (default: the submission folder's .venv)"),
    "DDPACK_DOCKER_ARGS": Setting(None, "", "docker-hostnet.sbatch: extra `docker run` options (e.g. --gpus all)"),
    "DDPACK_TEMPLATE": Setting(
        r"(?!preflight\.sbatch$)[A-Za-z0-9._-]+\.sbatch", "pyxis-per-task.sbatch", "preflight.sbatch: the template whose shape it checks"
    ),
    "DDPACK_COMMAND": Setting(None, "", "your program, run by every rank (a JSON list keeps each word exactly)", words=True),
    "DDPACK_TRAIN_ARGS": Setting(None, "", "the bundled trainer's flags", words=True),
    "DDPACK_PREFLIGHT_ARGS": Setting(None, "", "the preflight's extra flags", words=True),
    "DDPACK_LAUNCH_ARGS": Setting(None, "", "the entrypoint's own options (e.g. --nproc-per-node 2)", words=True),
    "DDPACK_NPROC": Setting(POSITIVE, "", "pyxis-torchrun.sbatch: ranks a node (torchrun's --nproc-per-node)"),
    # Starting, stopping, restarting.
    "DDPACK_PREFLIGHT": Setting(r"0|1|only", "0", "1: the preflight first, in the image; only: the preflight alone"),
    "DDPACK_MAX_RESTARTS": Setting(WHOLE, "10", "requeues after a preemption, at most"),
    "DDPACK_MAX_FAILURE_RESTARTS": Setting(WHOLE, "1", "restarts after a failure or a hang, at most"),
    "DDPACK_RESTART_IN_PLACE": Setting(r"0|1", "1", "1: a failed step restarts in this allocation; 0: the job is requeued"),
    "DDPACK_SPARE_NODES": Setting(WHOLE, "0", "nodes held back to replace a bad one"),
    "DDPACK_STANDBYS": Setting(
        r"auto|\d+",
        "auto",
        "pyxis-per-task, baremetal: warm standby processes of the bundled trainer; a rank that dies is replaced in process "
        "(auto: 1 where the job asks for no GPUs and runs the bundled trainer, else 0)",
    ),
    "DDPACK_STEP_WAIT": Setting(
        WHOLE, "120", "seconds srun gives a step's other tasks once one has ended; with standbys, once rank 0 has (0: for ever)"
    ),
    "DDPACK_HANG_TIMEOUT": Setting(SECONDS, "180", "seconds with no rank finishing a step before the watchdog ends the job (0: off)"),
    "DDPACK_STOP_GRACE": Setting(GRACE, "60", "seconds a program of yours gets to stop after SIGUSR1, in (0, 3600]"),
    "DDPACK_SHUTDOWN_TIMEOUT": Setting(POSITIVE, "30", "seconds torchrun's agent waits for its workers to stop"),
    "DDPACK_UMASK": Setting(r"0?[0-7]{3}", "077", "the job's umask: 077, its files are yours alone; 027, your group reads them"),
    "DDPACK_BACKEND": Setting(r"gloo|nccl|mpi|ucc", "", "the process group's backend (default: nccl with CUDA, else gloo)"),
    "DDPACK_CPU_BIND": Setting(r"auto|none", "auto", "auto: ranks that share a node each bind to their own slice of its CPUs"),
    "DDPACK_TENSORBOARD_DIR": Setting(None, "", "the trainer also writes TensorBoard event files there"),
    # The image on the nodes.
    "DDPACK_STAGE": Setting(r"auto|sbcast|off", "auto", "how the nodes get the squashfs: sbcast to local disk, or read it where it is"),
    "DDPACK_STAGE_DIR": Setting(r"/.*", "/tmp/ddpack-images-<uid>", "the nodes' local folder for staged images (yours alone)"),
    "DDPACK_STAGE_KEEP": Setting(POSITIVE, "2", "staged images kept a node"),
    "DDPACK_STAGE_FANOUT": Setting(
        r"[1-9]|[1-5][0-9]|6[0-4]", "8", "sbcast's fan-out: up to 64 on Slurm 23.11+ (every hop); 8 at most before (its first hop only)"
    ),
    "DDPACK_FSX_MBPS": Setting(POSITIVE, "1200", "the shared filesystem's read rate, MB/s, for the staging model"),
    "DDPACK_SBCAST_MBPS": Setting(POSITIVE, "1000", "sbcast's rate, MB/s, for the staging model"),
    "DDPACK_UNPACK_MBPS": Setting(POSITIVE, "400", "a node's unpack rate, MB/s, for the staging model"),
    # Set by ddpack itself.
    "DDPACK_HOME": Setting(None, "", "the folder of the job's helpers (ddpack submit: the run folder's job/)", own=True),
    "DDPACK_JOB_TOKEN": Setting(None, "", "this start's secret for the watchdog's store (made by the template)", own=True),
    "DDPACK_STORE_TASK": Setting(
        r"0|1", "0", "1: the step's last task serves the job's store, not rank 0 (set by the job with its standbys)", own=True
    ),
    "DDPACK_TEST_DIE_IN_SYNC": Setting(
        r"\d+:\d+", "", "tests only: RANK:STEP, that rank SIGKILLs itself between two gradient buckets of that step (--recovery)", own=True
    ),
    "DDPACK_TEST_DIE_IN_PROGRESS": Setting(
        r"\d+:.+",
        "",
        "tests only: RANK:FILE, that rank SIGKILLs itself in its next progress all-reduce once FILE exists (--recovery)",
        own=True,
    ),
    "DDPACK_TEST_DIE_IN_SNAPSHOT": Setting(
        r"\d+:.+",
        "",
        "tests only: RANK:FILE, that rank SIGKILLs itself in its next snapshot's gather once FILE exists (--recovery)",
        own=True,
    ),
    "DDPACK_END_FILE": Setting(None, "", "where a program of yours records how it ended (the launcher's, per rank)", own=True),
    "DDPACK_SNAPSHOT_DIR": Setting(None, "", "the run folder's snapshots/ (the template's)", own=True),
    "DDPACK_METRICS_FILE": Setting(None, "", "the run folder's metrics.jsonl (the template's)", own=True),
    "DDPACK_FORENSICS_DIR": Setting(None, "", "the run folder's forensics/ (the template's)", own=True),
    "DDPACK_WORKER_STACKS_DIR": Setting(None, "", "a rank's DataLoader workers' stacks folder (the trainer's)", own=True),
    "DDPACK_APP_CMD": Setting(None, "", "the project's command (the image's, from make image APP_CMD=)", own=True),
    "DDPACK_APP_DIR": Setting(None, "", "the project's folder in the image (/opt/app)", own=True),
}


def problems(environ: Mapping[str, str]) -> list[str]:
    """Each DDPACK_* variable of `environ` whose value the table refuses, one line each (unknown names are not
    refused here: a submitting shell's stray variables reach a job through --export=ALL; submit refuses them)."""
    found = []
    for name, value in sorted(environ.items()):
        setting = SETTINGS.get(name)
        if setting is not None and (why := setting.problem(name, value)) is not None:
            found.append(why)
    return found


def value(name: str, environ: Mapping[str, str]) -> str:
    """NAME as a job sees it: its value in `environ`, else the table's default (<uid>: this user's), the one place a
    default is written."""
    return environ.get(name) or SETTINGS[name].default.replace("<uid>", str(os.getuid()))


def command_words(text: str) -> list[str]:
    """A command setting's words (DDPACK_COMMAND, DDPACK_TRAIN_ARGS, ...), its pattern checked first: a value that
    starts with [ is a JSON list of strings, each word exactly as given (what `ddpack submit -- CMD` writes); any other
    is split on whitespace, the hand-made form. The job's `words` verb and `ddpack try` read them so."""
    return json.loads(text) if text.startswith("[") else text.split()


# What a training step runs, as far as the standbys are concerned (`step_program`).
TRAINER, OWN, IMAGE, TORCHRUN, UNKNOWN = "trainer", "own", "image", "torchrun", "unknown"


def step_program(*, command: bool, train_args: bool, torchrun: bool, image_command: str | None) -> str:
    """What a training step runs: TORCHRUN (torchrun starts a node's ranks: a task is no rank), OWN (a program of the
    user's: DDPACK_COMMAND, `ddpack submit -- CMD`), TRAINER (the bundled trainer: its flags are given, or the image's
    own command is none), IMAGE (the image's own command, its APP_CMD), or UNKNOWN (no record says which the image
    runs). `image_command`: the image's APP_CMD ("" for none, None when not known)."""
    if torchrun:
        return TORCHRUN
    if command:
        return OWN
    if train_args or image_command == "":
        return TRAINER
    return UNKNOWN if image_command is None else IMAGE


@dataclass(frozen=True)
class Recovery:
    """Which recovery a run's training step has, and why: `standbys` warm standby processes of the bundled trainer (a
    rank that dies is replaced in process, the others keep training), or none (a rank's death ends the step, which
    restarts from the last snapshot under DDPACK_MAX_FAILURE_RESTARTS)."""

    standbys: int
    why: str
    on_spares: bool = False  # the standbys live on the job's spare nodes (DDPACK_SPARE_NODES), as many a spare as a node's ranks

    @property
    def mode(self) -> str:
        return "in-process" if self.standbys else "restart"

    def line(self) -> str:
        """One line for people: which recovery and why."""
        if self.standbys:
            where = " on the spare nodes" if self.on_spares else ""
            return f"in-process recovery with {self.standbys} standby process(es){where} ({self.why})"
        return f"a restart of the step from its last snapshot ({self.why})"

    def fields(self) -> dict[str, object]:
        """As a record holds it (the job's `recovery` decision, run.json's settings)."""
        return {"mode": self.mode, "standbys": self.standbys, "why": self.why, **({"on_spares": True} if self.on_spares else {})}


def recovery(given: str, *, gpus: int, program: str, spares: int = 0, per_node: int | None = None) -> Recovery:
    """The standbys a training step starts, from DDPACK_STANDBYS as the job sees it (`given`: a count, or auto, the
    default) and the facts: the one place the default's rule is written (the job's program and `ddpack submit` both
    ask it). A count given is taken as given (the callers refuse one that cannot hold, each in one line). auto: one
    standby where it is free, none where it is not: a standby is a task of the bundled trainer's per-task step, so
    none for any other program; on GPU nodes it would hold a GPU of its own on a node that trains, idle until a rank
    dies, so a CUDA job has none unless it asks; on CPU nodes it is one process that sleeps while it waits.

    With `spares` spare nodes (DDPACK_SPARE_NODES) and `per_node` ranks a node, the spares host the standbys: as many
    on each spare as a node has ranks, so that one spare can take every rank of a node lost (set DOWN, as a health
    agent does) in process, and no GPU of a node that trains idles for one (a CUDA job gets them too, for the spares'
    GPUs idle anyway). Wherever standbys are asked for or free (a count above 0, or auto's one), and only there."""
    plain = _plain_recovery(given, gpus=gpus, program=program)
    wanted = plain.standbys or (given == "auto" and program == TRAINER)
    if spares > 0 and per_node and wanted:
        given_why = plain.why if plain.standbys else "a CUDA job: on the spares no GPU of a node that trains idles for them"
        why = f"{per_node} on each spare node, as many as a node's ranks, so that a lost node's ranks are replaced in process; {given_why}"
        return Recovery(spares * per_node, why, on_spares=True)
    return plain


def _plain_recovery(given: str, *, gpus: int, program: str) -> Recovery:
    """`recovery` without spare nodes: the standbys one a node on the nodes that train."""
    if given != "auto":
        count = int(given)
        return Recovery(count, f"{'asked for' if count else 'none asked for'}: DDPACK_STANDBYS={count} (ddpack submit --standbys {count})")
    if program == TORCHRUN:
        return Recovery(0, "torchrun starts a node's ranks itself, so a task is no rank and none can be a standby")
    if program == OWN:
        return Recovery(
            0,
            "your own program runs (a command after --, `python -m train` too), and standbys are tasks of the bundled"
            " trainer's per-task step: its flags as DDPACK_TRAIN_ARGS, with no command, let it have them",
        )
    if program == IMAGE:
        return Recovery(0, "the image runs its own command (its APP_CMD), and standbys are tasks of the bundled trainer")
    if program == UNKNOWN:
        return Recovery(0, "no make sqsh record says the image runs the bundled trainer; DDPACK_STANDBYS=1 asks for a standby if it does")
    if gpus:
        return Recovery(0, "a CUDA job: a standby would hold a GPU of its own, idle until a rank dies; DDPACK_STANDBYS=K asks for K")
    return Recovery(1, "the default where the nodes have no GPUs: one standby, a process that sleeps while it waits")


def container_path(path: str, mounts: str) -> str | None:
    """`path` as the container sees it through `mounts` (pyxis' --container-mounts: comma-separated SRC[:DST[:FLAGS]],
    DST defaulting to SRC; the longest SRC above it wins), or None when no mount holds it. The one definition, beside
    DDPACK_MOUNTS' row: the host's submit loads it (ddpack/job_side.py), so both sides agree, on a mount of `/` too
    (`/:/host`)."""
    best: tuple[str, str] | None = None
    for entry in filter(None, mounts.split(",")):
        src, _, rest = entry.partition(":")
        dst = rest.split(":")[0] or src
        src, dst = src.rstrip("/"), dst.rstrip("/")  # "/" becomes "": a prefix of every absolute path
        if f"{path}/".startswith(f"{src}/") and (best is None or len(src) > len(best[0])):
            best = (src, dst)
    if best is None:
        return None
    return (best[1] + path[len(best[0]) :]) or "/"


def shell_defaults() -> str:
    """The table's defaults as one bash line, `ddpack_defaults=([NAME]=VALUE ...)` (<uid>: this user's), which
    ddpack-job.sh evaluates when it is sourced: the templates read a default through `ddpack_value`, never write one."""
    pairs = (f"[{name}]={shlex.quote(value(name, {}))}" for name, setting in SETTINGS.items() if setting.default)
    return f"ddpack_defaults=({' '.join(pairs)})\n"


def markdown() -> str:
    """The table as docs/cluster.md shows it (`python3 enroot/ddpack_settings.py markdown` writes it)."""
    rows = ["| setting | default | accepts | what it is |", "|---|---|---|---|"]
    for name, setting in SETTINGS.items():
        if setting.own:
            continue
        accepts = "a JSON list of strings, or words" if setting.words else f"`{setting.pattern}`" if setting.pattern else "any text"
        default = f"`{setting.default}`" if setting.default else ""
        rows.append(f"| `{name}` | {default} | {accepts.replace('|', chr(92) + '|')} | {setting.meaning} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["markdown"]:
        print(markdown(), end="")
        return 0
    if argv == ["defaults"]:
        print(shell_defaults(), end="")
        return 0
    if argv != ["check"]:
        print("usage: ddpack_settings.py check|markdown|defaults", file=sys.stderr)
        return 2
    found = problems(os.environ)
    for line in found:
        print(f"ddpack: error: {line}", file=sys.stderr)
    return 2 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
