"""`ddpack`: one command from your project to a running job and back (docs/commands.md).

    ddpack submit   [APP_DIR] [--file run.toml] --nodes N [...] [--dry-run] [--json] [-- COMMAND...]
                    [--sweep NAME=V1,V2 | --point NAME=V,NAME=V... | --points FILE | --sample N [--sample-seed S]]
    ddpack try      [APP_DIR] [submit's options] [--index I] [--timeout S] [--lines N] [--dry-run] [--json] [-- COMMAND...]
    ddpack status   [RUN|SWEEP|JOB_ID] [--point I] [--json] [--watch]
    ddpack logs     [RUN|SWEEP|JOB_ID] [--point I] [-f] [--rank R] [--json]
    ddpack cancel   RUN|SWEEP|JOB_ID [--json]
    ddpack ls       [--runs DIR] [--state S,...] [--name GLOB] [--since WHEN] [--tag K=V] [--sort KEY] [--reverse] [--json]
    ddpack tag      RUN|SWEEP [KEY=VALUE...] [--rm KEY] [--note TEXT]
    ddpack resubmit RUN|JOB_ID [--time T] [--nodes N] [--partition P] [--json]
    ddpack resubmit SWEEP --failed|--state S,... [--time T] [--nodes N] [--partition P] [--json]
    ddpack report   RUN|SWEEP|JOB_ID [--png] [--json]
    ddpack compare  RUN|JOB_ID RUN|JOB_ID... [--json] [--html PATH]
    ddpack compare  SWEEP [--sort KEY] [--reverse] [--best KEY [--max]] [--json] [--html PATH]
    ddpack export   RUN|SWEEP... [--csv FILE] [--summary FILE] [--tensorboard DIR] [--json]
    ddpack halve    SWEEP --rungs STEP,STEP,... --by KEY [--max] [--interval S] [--once] [--json]
    ddpack rm       RUN|SWEEP|JOB_ID [--json]
    ddpack gc       --images [DIR] [--runs DIR] [--dry-run] [--json]
    ddpack completion bash|zsh

Host side only: Slurm's own commands (sbatch, squeue, sacct where there is accounting, scancel) and the run folder.
Bad input is one line and exit 2. --json prints one object (ls: a list of them) with status --json's names: run_dir,
job_id, state, ...; `status --watch` and `logs -f` exit 0 when the run COMPLETED, else by its state (3 CANCELLED,
4 TIMEOUT, 5 PREEMPTED, 6 FAILED: slurm_cli.EXIT_FOR_STATE), never 1, which is ddpack's own failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpack.errors import HostError, run_verb
from ddpack.job_side import setting_value
from ddpack.jobs.sweep_points import is_sweep

if TYPE_CHECKING:
    from ddpack.jobs.run_toml import RunFile
    from ddpack.jobs.submit_checks import SubmitSettings

TEMPLATE_CHOICES = ("per-task", "torchrun")
IMAGES = "/fsx/images"  # the shared images folder when neither --images nor DDPACK_IMAGES names one (a host setting)
TRY_HELP = (
    "run one point of a sweep (or the command) here, in the job's image, with the job's command, environment and mounts, "
    "in a one-task world: the first lines and the exit status (--dry-run: the docker command; --json: one object)"
)
TRY_TIMEOUT_S = 120.0  # try --timeout's default: long enough to import torch and take some steps, short enough to wait for
TRY_LINES = 20  # try --lines' default


def _whole(text: str) -> int:
    if not text.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def _env_pair(text: str) -> tuple[str, str]:
    """NAME=VALUE, or NAME alone for a value from this environment (a secret: never in argv, where `ps` shows it)."""
    name, sep, value = text.partition("=")
    if not sep:
        if name not in os.environ:
            raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE, and {name} is not set in this environment")
        value = os.environ[name]
    return name, value


class _Once(argparse._StoreAction):
    """A single-valued option (--after RUN, --time T): given twice, it is noted for main to refuse in one line, never
    the last one kept silently (argparse's own way), which ran something other than one of the two meant."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        first = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in first and "_repeated" not in namespace:
            namespace._repeated = f"{option_string} is given twice ({first[self.dest]}, then {values}); give it once"
        first.setdefault(self.dest, values)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """ddpack's parser and every verb's: an option that takes one value takes it once (_Once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="ddpack", description=__doc__.splitlines()[0])
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=_Parser)
    runs_help = "the runs folder (default: DDPACK_RUNS, else /fsx/<user>/ddpack-runs)"
    images_help = f"DDPACK_IMAGES, else {IMAGES}"
    json_help = "print one JSON object (status --json's names: run_dir, job_id, state, ...)"

    # No abbreviated flags: a flag is named in full, so a run file's value is never blamed for a flag typed as --tim.
    sub = verbs.add_parser("submit", help="build, convert and submit a project (only what changed), recording what ran", allow_abbrev=False)
    # Every option the run file can hold defaults to None here: a flag given wins over the file, the file over the default.
    sub.add_argument("app_dir", nargs="?", default=None, type=Path, help="the project folder (default: the run file's, else here)")
    sub.add_argument("--file", type=Path, help="a run file (TOML) holding these options; flags given here win over it")
    sub.add_argument("--nodes", type=_whole, help="nodes that train (required, here or in the run file)")
    sub.add_argument("--tasks-per-node", type=_whole, help="ranks per node (default: one per GPU with --gpus-per-node, else 1)")
    sub.add_argument(
        "--spares", type=_whole, help=f"spare nodes held for a restart in place (default {setting_value('DDPACK_SPARE_NODES')})"
    )
    sub.add_argument(
        "--standbys",
        type=_whole,
        metavar="K",
        help="warm standby processes of the bundled trainer: a rank that dies is replaced in process, the others keep "
        "training (default: 1 where the job asks for no GPUs and runs the bundled trainer, else 0; docs/recovery.md)",
    )
    sub.add_argument(
        "--gpus-per-node", type=_whole, help="GPUs a node: builds the project on the CUDA image (Dockerfile.gpu), one rank per GPU"
    )
    sub.add_argument(
        "--efa", action="store_true", default=None, help="with --gpus-per-node: the CUDA image with AWS's EFA installer (p4d, p5)"
    )
    sub.add_argument("--partition")
    sub.add_argument("--time", dest="time_limit", help="Slurm's time limit, e.g. 4:00:00")
    sub.add_argument("--template", choices=TEMPLATE_CHOICES, help="per-task (default): one Slurm task a rank; torchrun: one a node")
    sub.add_argument("--mounts", help=f"pyxis' --container-mounts (default: DDPACK_MOUNTS, else {setting_value('DDPACK_MOUNTS')})")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--images", type=Path, default=None, help=f"the shared images folder (default: {images_help})")
    sub.add_argument("--sqsh", type=Path, help="a squashfs made already (make sqsh): nothing is built or converted")
    sub.add_argument("--name", help="the job's and run folder's name (default: the project folder's)")
    sub.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="a variable for the job, written in its script and run.json (repeatable; NAME alone: its value from this shell); "
        "nothing else of this shell but PATH, HOME, USER, LOGNAME, LANG, LC_ALL and TZ reaches the job",
    )
    sub.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a variable whose value (from this shell) Slurm hands to the job: in no file, script, record or log (repeatable)",
    )
    sub.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="run the command once per value, {NAME} in its words replaced (repeatable: the cross product), as one job array",
    )
    sub.add_argument(
        "--point", action="append", default=[], metavar="NAME=V,NAME=V",
        help="one point of a sweep, listed (repeatable: the points in order, no grid)",
    )  # fmt: skip
    sub.add_argument("--points", type=Path, metavar="FILE", help='a sweep\'s points listed in a file: JSON lines of {"NAME": value}')
    sub.add_argument(
        "--sample", type=_whole, metavar="N",
        help="N points drawn at random from the --sweep names (NAME=V1,V2 a choice, NAME=loguniform(A,B), uniform(A,B), randint(A,B))",
    )  # fmt: skip
    sub.add_argument("--sample-seed", type=int, metavar="S", help="--sample's seed (default: one chosen, printed and kept in sweep.json)")
    sub.add_argument("--sweep-parallel", type=_whole, help="at most this many of the sweep's points at once (the array's %%)")
    for flag, text in (("--account", "Slurm's account to charge"), ("--qos", "Slurm's quality of service"),
                       ("--constraint", "node features the job needs (Slurm's --constraint, such as a100&ib)"),
                       ("--reservation", "a Slurm reservation to run in")):  # fmt: skip
        sub.add_argument(flag, help=text)
    sub.add_argument(
        "--sbatch-arg",
        dest="sbatch_args",
        action="append",
        default=[],
        metavar="OPTION",
        help="any other sbatch option, as one word (--sbatch-arg=--mem=0; repeatable); those ddpack sets itself are refused",
    )
    sub.add_argument(
        "--after", metavar="RUN[:ok|any|notok]", help="start once RUN (a run, sweep or job id) ended: ok (default), any way, or not ok"
    )
    sub.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="a tag for the run (repeatable); ls --tag finds it")
    sub.add_argument("--note", help="a note for the run, kept in run.json (ddpack tag --note changes it)")
    sub.add_argument("--dry-run", action="store_true", help="print the job script and run the checks; build, write and queue nothing")
    sub.add_argument("--json", action="store_true", help="print one JSON object (job_id, run_dir, ...)")
    sub.epilog = "-- COMMAND...: your program, run by every rank (default: the image's own command)"
    # try takes submit's options (its parser's parent) and its own, written here: parser() is built for every verb, and
    # ddpack.jobs.try_point (docker, threads, submit's checks) is imported only when try runs.
    sub = verbs.add_parser("try", parents=[sub], add_help=False, allow_abbrev=False, help=TRY_HELP, description=TRY_HELP)
    sub.add_argument("--index", type=int, metavar="I", help="the sweep's point I (default 0; submit's --point lists points)")
    sub.add_argument("--timeout", type=float, default=TRY_TIMEOUT_S, metavar="S",
                     help=f"stop it after S seconds (docker stop), exit 4 (default {TRY_TIMEOUT_S:g})")  # fmt: skip
    sub.add_argument(
        "--lines", type=int, default=TRY_LINES, metavar="N", help=f"how many of its first lines to print (default {TRY_LINES})"
    )

    for name, text in (
        ("status", "a run's state, segments, progress and ETA"),
        ("logs", "a run's job logs, across requeues"),
        ("cancel", "scancel a run's job"),
    ):
        sub = verbs.add_parser(name, help=text)
        newest = "none: it names the newest run and cancels nothing" if name == "cancel" else "the newest run"
        sub.add_argument("run", nargs="?", help=f"a run folder, a sweep's or a job id (default: {newest})")
        sub.add_argument("--runs", type=Path, default=None, help=runs_help)
        sub.add_argument("--json", action="store_true", help=json_help)
    for name in ("status", "logs"):
        verbs.choices[name].add_argument("--point", type=_whole, metavar="I", help="a sweep's point I alone (its folder SWEEP/I)")
    verbs.choices["status"].add_argument("--watch", action="store_true", help="refresh until the job ends; exit 0 when it COMPLETED")
    verbs.choices["status"].add_argument("--interval", type=float, default=2.0, help="--watch's refresh, seconds")
    verbs.choices["logs"].add_argument("-f", "--follow", action="store_true", help="follow until the job ends; exit 0 when it COMPLETED")
    verbs.choices["logs"].add_argument("--rank", type=_whole, help="only rank R's lines")
    sub = verbs.add_parser("ls", help="every run with its state and progress")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print one JSON list of runs (status --json's names)")
    sub.add_argument("--state", metavar="S,S,...", help="only runs in these states (COMPLETED,FAILED,...)")
    sub.add_argument("--name", metavar="GLOB", help="only runs whose name matches (shell wildcards: 'lr-*')")
    sub.add_argument("--since", metavar="WHEN", help="only runs submitted since: 30m, 6h, 2d, or a date 2026-11-26[THH:MM]")
    sub.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="only runs with this tag (repeatable: all of them)")
    sub.add_argument(
        "--sort", metavar="KEY", default="created",
        help="order: created (default), name, state, step, loss, or any eval metric a run recorded (eval_loss, val_acc; a sweep's points too)",
    )  # fmt: skip
    sub.add_argument("--reverse", action="store_true", help="the other way round (newest first, highest first)")
    sub.add_argument("--no-slurm", action="store_true", help="the run folders alone, no squeue or sacct (a live run's state: -)")
    sub = verbs.add_parser("tag", help="set or remove a run's (or every point of a sweep's) tags and note")
    sub.add_argument("run", help="a run folder, a sweep's or a job id")
    sub.add_argument("tags", nargs="*", metavar="KEY=VALUE", help="tags to set")
    sub.add_argument("--rm", action="append", default=[], metavar="KEY", help="a tag to remove (repeatable)")
    sub.add_argument("--note", help="the run's note (an empty one removes it)")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print one object: run_dir, tags, note")
    for name, text in (
        ("resubmit", "a new job continuing a run, with the same job script and image"),
        ("report", "the run's report.html and node-hour ledger (a sweep: its ledger)"),
    ):
        sub = verbs.add_parser(name, help=text)
        sub.add_argument("run", help="a run folder or a job id")
        sub.add_argument("--runs", type=Path, default=None, help=runs_help)
        sub.add_argument("--json", action="store_true", help=json_help)
    verbs.choices["report"].add_argument("--png", action="store_true")
    again = verbs.choices["resubmit"]
    again.add_argument("--time", dest="time_limit", help="a new time limit for this job (after a TIMEOUT: a longer one)")
    again.add_argument("--nodes", type=_whole, help="nodes that train in this job (the run's spares come on top)")
    again.add_argument("--partition", help="the partition for this job")
    again.add_argument(
        "--failed", action="store_true", help="a sweep's FAILED and TIMEOUT points (NODE_FAIL, OUT_OF_MEMORY too), as one job array"
    )
    again.add_argument(
        "--state", metavar="S,S,...", help="a sweep's points in these states instead (--state CANCELLED,TIMEOUT), as one job array"
    )
    sub = verbs.add_parser("compare", help="what differed between runs (image, code, settings, command, environment) and how each ended")
    sub.add_argument("run", nargs="+", help="two run folders or job ids, or more")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print one object: runs (each with its outcome), differ, same")
    sub.add_argument("--html", type=Path, default=None, help="write the page overlaying their curves here (none unless asked)")
    sub.add_argument(
        "--sort", metavar="KEY", help="a sweep's points by a swept name, a column (train_loss, eval_loss, ...) or any eval metric (val_acc)"
    )
    sub.add_argument("--reverse", action="store_true", help="with --sort: highest first")
    sub.add_argument(
        "--best", metavar="KEY", help="a sweep's best point by KEY (as --sort takes it): the lowest, or the highest with --max"
    )
    sub.add_argument("--max", dest="highest", action="store_true", help="with --best: the highest is best (accuracy)")
    sub = verbs.add_parser("export", help="runs' records out of ddpack: CSV (a row a record, or a run), TensorBoard event files")
    sub.add_argument("run", nargs="+", help="run folders, sweeps' (their points) or job ids")
    sub.add_argument("--csv", type=Path, metavar="FILE", help="one row a metrics record, with each run's values and tags")
    sub.add_argument("--summary", type=Path, metavar="FILE", help="one row a run: its values, tags and how it ended (CSV)")
    sub.add_argument("--tensorboard", type=Path, metavar="DIR", help="one folder a run (named by its values) of TensorBoard event files")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print one object: runs, and each file or folder written")
    sub = verbs.add_parser("halve", help="successive halving: at each rung (step) pause the worse half of a sweep's live points")
    sub.add_argument("run", help="a sweep's folder or its array's job id")
    sub.add_argument("--rungs", required=True, metavar="STEP,STEP,...", help="the steps at which to halve, rising (20,40,80)")
    sub.add_argument(
        "--by", required=True, metavar="KEY", help="the metric that ranks the points: an eval metric (eval_loss, val_acc) or loss"
    )
    sub.add_argument("--max", dest="highest", action="store_true", help="the highest is best (accuracy); default: the lowest")
    sub.add_argument("--interval", type=float, default=30.0, help="seconds between looks at the sweep (default 30)")
    sub.add_argument("--once", action="store_true", help="one look: decide what can be decided now, then exit (for cron)")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print each decision as one JSON line")
    sub = verbs.add_parser("rm", help="delete a run's or a sweep's folder, once none of its jobs lives")
    sub.add_argument("run", help="a run folder, a sweep's folder or a job id")
    sub.add_argument("--runs", type=Path, default=None, help=runs_help)
    sub.add_argument("--json", action="store_true", help="print one object: run_dir, jobs")
    sub = verbs.add_parser("gc", help="remove your squashfs files in the images folder that no run and no live job of yours names")
    sub.add_argument("--images", nargs="?", const=True, type=Path, required=True, metavar="DIR",
                     help=f"the images folder (alone: {images_help})")  # fmt: skip
    sub.add_argument("--runs", type=Path, default=None, help=runs_help + ": the runs whose images are kept")
    sub.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    sub.add_argument("--json", action="store_true", help="print one object: removed (or would_remove), bytes")
    sub = verbs.add_parser("completion", help="print the shell completion script (bash: source <(ddpack completion bash))")
    sub.add_argument("shell", choices=("bash", "zsh"))
    return top


def main(argv: list[str] | None = None) -> int:
    """Parse the words, then run the verb's function (VERBS); a HostError is one line and its exit code (run_verb)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:  # submit's program: everything after --, never read as ddpack's own arguments
        command, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    while "--sbatch-arg" in argv[:-1]:  # --sbatch-arg --mem=0: a value that begins with a dash, which argparse takes for a flag
        i = argv.index("--sbatch-arg")
        argv[i : i + 2] = [f"--sbatch-arg={argv[i + 1]}"]
    opts = parser().parse_args(argv)
    opts.command, opts.given = command, argv

    def body() -> int:
        if getattr(opts, "_repeated", None):
            raise HostError(opts._repeated, code=2)
        return VERBS[opts.verb](opts)

    return run_verb(opts.verb, body)


def submit(opts: argparse.Namespace) -> int:
    """The flags over the run file (--file) over the defaults, then ddpack.jobs.submit."""
    from ddpack.jobs.submit import as_json
    from ddpack.jobs.submit import submit as do_submit

    settings, run_file = submit_settings(opts)
    kept = run_file.record() if run_file else None
    if opts.json:  # stdout holds the one JSON object: what the build and conversion print (their tools too) goes to stderr
        with stdout_to_stderr():
            result = do_submit(settings, dry_run=opts.dry_run, say=print, run_file=kept)
        print(as_json(result))
        return 0
    result = do_submit(settings, dry_run=opts.dry_run, say=print, run_file=kept)
    if result.job_id:
        print("next:\n" + "\n".join(f"  {line}" for line in result.next_commands()))
    return 0


def try_verb(opts: argparse.Namespace) -> int:
    """try: submit's arguments read as submit reads them, then one point run here (ddpack.jobs.try_point)."""
    from ddpack.jobs.try_point import try_point

    return try_point(opts, submit_settings(opts)[0])


def submit_settings(opts: argparse.Namespace) -> tuple[SubmitSettings, RunFile | None]:
    """(SubmitSettings, the run file or None): submit's flags over the run file (--file) over the defaults, a value from
    the file that the checks refuse named by its line there. `submit` and `try` read their arguments so."""
    from ddpack.jobs import find_runs
    from ddpack.jobs.run_toml import read_run_file
    from ddpack.jobs.search import sweep_space
    from ddpack.jobs.submit_checks import SubmitSettings, raise_problems, setting_problems

    run_file = read_run_file(opts.file) if opts.file else None
    argv_flags = {word.split("=")[0] for word in opts.given if word.startswith("--")}
    given = run_file.values if run_file else {}

    def pick(attr: str, key: str | None = None, default: Any = None) -> Any:
        flag = getattr(opts, attr)
        return flag if flag is not None else given.get(key or attr, default)

    nodes = pick("nodes")
    if nodes is None:
        raise HostError("how many nodes? --nodes N (or nodes = N in a run file, --file run.toml)", code=2)
    gpus = pick("gpus_per_node", default=0)
    tasks = pick("tasks_per_node")
    if tasks is not None and gpus and tasks != gpus:
        print(
            f"ddpack submit: warning: --tasks-per-node {tasks} with --gpus-per-node {gpus}: {tasks} ranks a node share "
            f"{gpus} GPUs, where one rank per GPU is the rule (leave --tasks-per-node out for it)",
            file=sys.stderr,
        )
    env = {**run_file.passed_env(os.environ), **given.get("env", {})} if run_file else {}
    runs = pick("runs") or find_runs.default_runs()
    images = pick("images") or Path(os.environ.get("DDPACK_IMAGES") or IMAGES)
    space = sweep_space(opts.sweep, given.get("sweep", {}), point_flags=opts.point, points_file=opts.points, sample=opts.sample,
                        seed=opts.sample_seed, say=lambda line: print(line, file=sys.stderr if opts.json else sys.stdout))  # fmt: skip
    settings = SubmitSettings(
        app_dir=(opts.app_dir or given.get("app_dir") or Path(".")).resolve(),
        nodes=nodes,
        tasks_per_node=tasks if tasks is not None else (gpus or 1),
        spares=pick("spares", default=int(setting_value("DDPACK_SPARE_NODES"))),
        standbys=pick("standbys"),
        gpus_per_node=gpus,
        efa=pick("efa", default=False),
        partition=pick("partition"),
        time_limit=pick("time_limit", "time"),
        template=pick("template", default="per-task"),
        mounts=pick("mounts") or setting_value("DDPACK_MOUNTS", os.environ),
        runs=Path(runs).resolve(),
        images=Path(images).resolve(),
        env={**env, **dict(opts.env)},
        command=tuple(opts.command or given.get("command", ())),
        sqsh=pick("sqsh"),
        name=pick("name"),
        secrets=tuple(dict.fromkeys([*given.get("secrets", []), *opts.secret])),
        sweep=space.values,
        sweep_listed=space.listed,
        sweep_search=space.search,
        sweep_parallel=pick("sweep_parallel"),
        account=pick("account"),
        qos=pick("qos"),
        constraint=pick("constraint"),
        reservation=pick("reservation"),
        sbatch_args=tuple([*given.get("sbatch", []), *opts.sbatch_args]),
        after=opts.after,
        dependency=dependency(opts.after, Path(runs).resolve()) if opts.after else None,
        tags={**given.get("tags", {}), **tag_pairs(opts.tag, "--tag")},
        note=pick("note"),
    )
    if run_file is not None:  # a value from the file that the checks refuse is named by its line there
        raise_problems([run_file.where(problem, argv_flags) for problem in setting_problems(settings)])
    return settings, run_file


AFTER = {"ok": "afterok", "any": "afterany", "notok": "afternotok"}


def dependency(after: str, runs: Path) -> str:
    """Slurm's --dependency for --after RUN[:ok|any|notok]: the run's newest job (a sweep: each point's, sweep_jobs)."""
    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.run_json import read_record

    run, _, kind = after.rpartition(":") if after.rpartition(":")[2] in AFTER else (after, "", "ok")
    if not run:
        raise HostError(f"--after {after}: expected RUN[:ok|any|notok] (a run folder, a sweep or a job id)", code=2)
    try:
        folder = resolve_run(run, runs)
    except HostError as why:
        raise HostError(f"--after {after}: {why}", code=2) from None
    if is_sweep(folder):
        jobs = sweep_jobs(folder)
    else:
        last = read_record(folder).last_job
        jobs = [last.job_id] if last else []
    if not jobs:
        raise HostError(f"--after {after}: {folder} has no job to wait for", code=2)
    return f"{AFTER[kind]}:{':'.join(jobs)}"


def sweep_jobs(folder: Path) -> list[str]:
    """The jobs a wait for the sweep waits for: its array while every point's newest job is its element of it, else
    each point's newest job (a point resubmitted after it failed: the mend's element, never the failed one, which
    would hold an afterok for good)."""
    from ddpack.jobs.run_json import read_record
    from ddpack.jobs.sweep_points import point_dirs, read_sweep

    array, points = read_sweep(folder).get("job_id"), point_dirs(folder)
    own = [f"{array}_{index}" if array else None for index in range(len(points))]  # a point with no job recorded: its element
    newest = [last.job_id if (last := read_record(point).last_job) else element for point, element in zip(points, own, strict=True)]
    if array and newest == own:
        return [str(array)]
    return [job for job in newest if job]


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 pointed at 2 for a while: Python's prints and every child process's output alike."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def status(opts: argparse.Namespace) -> int:
    """status: a run's state, segments, progress and ETA (--watch: until it ends); a sweep's, one line a point."""
    from ddpack.jobs.slurm_cli import exit_for
    from ddpack.jobs.status import render, run_status, watch

    run_dir = named_run(opts)
    if is_sweep(run_dir):
        return sweep_status(opts, run_dir)
    if opts.watch:
        final = watch(run_dir, interval_s=opts.interval, tty=sys.stdout.isatty(), out=sys.stdout, as_json=opts.json)
        return exit_for(final.state)
    result = run_status(run_dir)
    print(result.to_json() if opts.json else render(result))
    return 0


def tag_pairs(words: list[str], flag: str) -> dict[str, str]:
    """KEY=VALUE words as a dict; a bad one is one line, exit 2."""
    import re

    pairs = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", key) or re.search(r"[\x00-\x1f\x7f]", value):
            raise HostError(f"{flag} {word!r}: expected KEY=VALUE (a key of letters, digits, '.', '_', '-'; a value on one line)", code=2)
        pairs[key] = value
    return pairs


def listing(opts: argparse.Namespace) -> int:
    """ls: the runs, filtered and sorted, as lines or one JSON list."""
    from ddpack.jobs.listing import list_rows, pick_rows, render_list, since_time
    from ddpack.jobs.slurm_cli import ddpack_state

    runs = runs_folder(opts)
    states = tuple(ddpack_state(word.strip().upper()) for word in opts.state.split(",") if word.strip()) if opts.state else ()
    rows = pick_rows(list_rows(runs, ask_slurm=not opts.no_slurm), states=states, name=opts.name,
                     since=since_time(opts.since) if opts.since else None, tags=tag_pairs(opts.tag, "--tag"), sort=opts.sort,
                     reverse=opts.reverse)  # fmt: skip
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    lines = render_list(rows)
    print(
        "\n".join(lines) if lines else f"no runs under {runs}{' that match' if opts.state or opts.name or opts.since or opts.tag else ''}"
    )
    return 0


def tag(opts: argparse.Namespace) -> int:
    """ddpack tag: a run's tags and note (a sweep's: sweep.json's and every point's)."""
    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.run_json import update_tags
    from ddpack.jobs.sweep import tag_sweep
    from ddpack.jobs.sweep_points import point_dirs

    folder = resolve_run(opts.run, runs_folder(opts))
    pairs = tag_pairs(opts.tags, "tag")
    if not pairs and not opts.rm and opts.note is None:
        raise HostError("tag: give KEY=VALUE tags, --rm KEY or --note TEXT", code=2)
    now = {}
    for run_dir in point_dirs(folder) if is_sweep(folder) else [folder]:
        now = update_tags(run_dir, pairs, tuple(opts.rm), opts.note)
    if is_sweep(folder):
        now = tag_sweep(folder, pairs, tuple(opts.rm), opts.note)
    said = " ".join(f"{k}={v}" for k, v in now.items()) or "none"
    print(json.dumps({"run_dir": str(folder), "tags": now, "note": opts.note}, indent=2) if opts.json else f"tag: {folder}: tags {said}")
    return 0


def facts_of(folder: Path) -> str:
    """A run's or sweep's job id, for a sentence."""
    from ddpack.jobs.run_json import read_record
    from ddpack.jobs.sweep_points import read_sweep

    job = read_sweep(folder).get("job_id") if is_sweep(folder) else (last.job_id if (last := read_record(folder).last_job) else None)
    return str(job or "none")


def export(opts: argparse.Namespace) -> int:
    """export: the runs' records as CSV (a row a record; --summary a row a run) and TensorBoard event files."""
    from ddpack.jobs import export as exporting
    from ddpack.jobs.find_runs import resolve_run

    if not (opts.csv or opts.summary or opts.tensorboard):
        raise HostError("export writes --csv FILE, --summary FILE or --tensorboard DIR: name one or more", code=2)
    runs = runs_folder(opts)
    points = exporting.runs_of([resolve_run(run, runs) for run in opts.run])
    said: dict[str, Any] = {"runs": [str(point) for point in points]}
    if opts.csv:
        said["csv"] = {"file": str(opts.csv.resolve()), "rows": exporting.export_csv(points, opts.csv.resolve())}
    if opts.summary:
        said["summary"] = {"file": str(opts.summary.resolve()), "rows": exporting.export_summary(points, opts.summary.resolve())}
    if opts.tensorboard:
        said["tensorboard"] = [str(folder) for folder in exporting.export_tensorboard(points, opts.tensorboard.resolve())]
    if opts.json:
        print(json.dumps(said, indent=2))
        return 0
    for key in ("csv", "summary"):
        if key in said:
            print(f"export: wrote {said[key]['file']} ({said[key]['rows']} rows, {'a record' if key == 'csv' else 'a run'} each)")
    if "tensorboard" in said:
        where = opts.tensorboard.resolve()
        print(f"export: wrote {len(said['tensorboard'])} TensorBoard run folder(s) under {where}: tensorboard --logdir {where}")
    return 0


def halve(opts: argparse.Namespace) -> int:
    """halve: look at the sweep every --interval seconds, decide each rung once every point in the race reached it,
    pause the losers (cancel: the trainer's stop snapshot), until every rung is decided or no point is left."""
    from ddpack.jobs import run_actions, search
    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.status import run_status

    folder = resolve_run(opts.run, runs_folder(opts))
    if not is_sweep(folder):
        raise HostError(f"halve ranks a sweep's points; {folder} is one run", code=2)
    if opts.interval <= 0:
        raise HostError(f"--interval {opts.interval}: expected seconds > 0", code=2)
    asked = search.Halving(rungs=search.parse_rungs(opts.rungs), by=opts.by, highest=opts.highest)

    def pause(point: Path) -> None:
        with contextlib.suppress(HostError):  # it ended between the look and the cancel: nothing left to pause
            run_actions.cancel(point)

    def resume(point: Path) -> bool:
        try:
            run_actions.resubmit(point)
        except HostError as exc:  # its cancelled job is still ending (Slurm lists it): the next look tries again
            print(f"halve: point {point.name} cannot go on yet ({exc}); trying again at the next look", file=sys.stderr, flush=True)
            return False
        return True

    while True:
        done = search.halve_pass(folder, asked, state_of=lambda point: run_status(point).state, pause=pause, resume=resume,
                                 now=time.time)  # fmt: skip
        for decision in done.decisions:
            print(json.dumps(decision) if opts.json else search.decision_line(decision, asked.by).replace("SWEEP", str(folder)), flush=True)
        for index in done.held:
            print(json.dumps({"held": index}) if opts.json else f"halve: point {index} reached the next rung while another waits "
                  "for a node: held at its snapshot until the rung is decided", flush=True)  # fmt: skip
        for index in done.resumed:
            print(json.dumps({"resumed": index}) if opts.json else f"halve: point {index} goes on from its snapshot", flush=True)
        if done.over or opts.once:
            return 0
        time.sleep(opts.interval)


def collect_images(opts: argparse.Namespace) -> int:
    """gc --images: your squashfs files that no run of yours names, removed (or listed, --dry-run)."""
    from ddpack.jobs.image_gc import remove_images, unused_images

    runs = runs_folder(opts)
    images = (Path(os.environ.get("DDPACK_IMAGES") or IMAGES) if opts.images is True else opts.images).resolve()
    unused = unused_images(images, runs)
    if not opts.dry_run:
        remove_images(unused)
    total = sum(item.size for item in unused)
    if opts.json:
        print(
            json.dumps(
                {"images": str(images), "would_remove" if opts.dry_run else "removed": [str(i.path) for i in unused], "bytes": total},
                indent=2,
            )
        )
        return 0
    verb = "would remove" if opts.dry_run else "removed"
    for item in unused:
        print(f"gc: {verb} {item.path} ({item.size / 2**20:,.1f} MiB)")
    print(f"gc: {verb} {len(unused)} squashfs file(s) of yours, {total / 2**30:,.2f} GiB, that no run under {runs} names")
    return 0


def point_of(folder: Path, point: int | None) -> Path:
    """--point I: the sweep's point I (its run folder); without it, the folder itself."""
    from ddpack.jobs.sweep_points import point_dirs

    if point is None:
        return folder
    if not is_sweep(folder):
        raise HostError(f"--point {point}: {folder} is a run, not a sweep; --point picks one of a sweep's points", code=2)
    points = point_dirs(folder)
    if not 0 <= point < len(points):
        raise HostError(f"--point {point}: the sweep {folder} has points 0 to {len(points) - 1}", code=2)
    return points[point]


def report(opts: argparse.Namespace) -> int:
    """A run folder of any template's (or its metrics file), or a run of ddpack submit's named by a job id."""
    from ddpack.jobs import ledger as ledgers
    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.report import NoCharts, write_report
    from train.run_folder import RUN_RECORD

    path = Path(opts.run)
    run_dir = path if path.exists() else resolve_run(opts.run, runs_folder(opts))
    if is_sweep(run_dir):  # a sweep: its node-hour ledger (each point's report: ddpack report SWEEP/INDEX)
        total = ledgers.sweep_ledger(run_dir)
        print(
            json.dumps({"run_dir": str(run_dir), "ledger": total.to_json()}, indent=2)
            if opts.json
            else ledgers.render(total, f"the sweep {run_dir}")
        )
        return 0
    ours = (run_dir / RUN_RECORD).is_file()
    try:
        written = [str(p) for p in write_report(run_dir, with_png=opts.png)]
    except NoCharts as why:  # the host's light install: the ledger needs no chart
        if not ours:
            raise
        print(f"ddpack report: warning: no page written: {why}", file=sys.stderr)
        written = []
    ledger = ledgers.run_ledger(run_dir) if ours else None
    if opts.json:
        known = facts(run_dir) if ours else {"run_dir": str(run_dir.resolve()), "job_id": None, "state": None}
        print(json.dumps({**known, "files": written, "ledger": ledger.to_json() if ledger else None}, indent=2))
    else:
        print("\n".join([*(f"report: wrote {p}" for p in written), *([ledgers.render(ledger, f"the run {run_dir}")] if ledger else [])]))
    return 0


def sweep_status(opts: argparse.Namespace, folder: Path) -> int:
    """status of a sweep as a whole: one line a point (--watch: until every point ended, exit by the worst)."""
    from ddpack.jobs import sweep

    if opts.watch:
        final = sweep.watch_sweep(folder, interval_s=opts.interval, tty=sys.stdout.isatty(), out=sys.stdout, as_json=opts.json)
        print(sweep.ended_line(final), file=sys.stderr if opts.json else sys.stdout)
        return sweep.sweep_exit(final)
    now = sweep.sweep_status(folder)
    print(json.dumps(now, indent=2) if opts.json else sweep.render_sweep(now))
    return 0


def sweep_cancel(opts: argparse.Namespace, folder: Path) -> int:
    """cancel of a sweep as a whole: every point still waiting or running."""
    from ddpack.jobs import sweep

    jobs = sweep.cancel_sweep(folder)
    now = sweep.sweep_status(folder)
    facts_now = {**{key: now[key] for key in ("run_dir", "name", "job_id", "state")}, "cancelled": jobs}
    said = f"cancel: {', '.join(jobs)} of the sweep {folder} cancelled (scancel): every point still waiting or running"
    print(json.dumps(facts_now, indent=2) if opts.json else said)
    return 0


def sweep_logs(opts: argparse.Namespace, folder: Path) -> int:
    """logs of a sweep as a whole: each point's, under a line naming it (-f: until every point ended)."""
    from ddpack.jobs import logs as job_logs
    from ddpack.jobs import sweep

    if opts.follow:
        if opts.json:
            raise HostError(LOGS_JSON_FOLLOW, code=2)
        final = sweep.follow_sweep(folder, opts.rank, sys.stdout)
        print(sweep.ended_line(final))
        return sweep.sweep_exit(final)
    data = sweep.read_sweep(folder)
    if opts.json:
        print(json.dumps({"run_dir": str(folder), "job_id": data.get("job_id"), "points": [
            {"index": i, "values": data["points"][i], **facts(point), "jobs": job_logs.log_lines(point, opts.rank)}
            for i, point in enumerate(sweep.point_dirs(folder))]}, indent=2))  # fmt: skip
        return 0
    for index, point in enumerate(sweep.point_dirs(folder)):
        print(f"== point {index} ({sweep.point_label(data['points'][index])}): {point}")
        job_logs.print_logs(point, opts.rank)
    return 0


def sweep_resubmit(opts: argparse.Namespace, folder: Path) -> int:
    """resubmit of a sweep: its points in the states asked (--failed, --state) again, as one job array."""
    from ddpack.jobs import sweep

    if not (opts.failed or opts.state):
        raise HostError(
            f"{folder} is a sweep; resubmit --failed (or --state S,...) queues its failed points again, or name one point: "
            f"{folder}/INDEX, or its job id (<array>_INDEX)",
            code=2,
        )
    job, picked = sweep.resubmit_points(folder, sweep.mend_states(opts.state), changes_of(opts))
    said = (f"resubmit: job array {job} queues points {', '.join(map(str, picked))} of the sweep {folder} again, each in its own run "
            f"folder (the others untouched); ddpack status {folder} --watch follows them")  # fmt: skip
    print(json.dumps({"run_dir": str(folder), "job_id": job, "points": picked}, indent=2) if opts.json else said)
    return 0


def compare(opts: argparse.Namespace) -> int:
    from ddpack.jobs import compare as comparing
    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.sweep_points import point_dirs

    if opts.highest and not opts.best:
        raise HostError("--max goes with --best: compare SWEEP --best KEY --max", code=2)
    runs = runs_folder(opts)
    folders = [resolve_run(run, runs) for run in opts.run]
    if len(folders) == 1 and is_sweep(folders[0]):  # a sweep alone: one row a point, its values as columns
        names, rows, curves, total = comparing.sweep_table(folders[0], curves=bool(opts.html))
        curve_of = {row["index"]: curve for row, curve in zip(rows, curves, strict=True)}
        rows = comparing.sort_rows(rows, opts.sort, names, opts.reverse) if opts.sort else rows
        if opts.best:
            top, said = comparing.best_row(rows, opts.best, names, opts.highest)
            print(
                json.dumps({"run_dir": str(folders[0]), "by": opts.best, "highest": opts.highest, "best": top}, indent=2)
                if opts.json
                else said
            )
            return 0
        page = (
            comparing.write_sweep_page(folders[0], names, rows, [curve_of[r["index"]] for r in rows], opts.html.resolve())
            if opts.html
            else None
        )
        from ddpack.jobs import ledger as ledgers

        print(json.dumps({"run_dir": str(folders[0]), "names": names, "points": rows, "ledger": total.to_json(), "html": str(page) if page else None},
                         indent=2) if opts.json else comparing.render_sweep_table(names, rows, page) + "\n" + ledgers.render(total, "the sweep"))  # fmt: skip
        return 0
    if opts.sort or opts.best:
        raise HostError(
            f"{'--sort' if opts.sort else '--best'} ranks a sweep's points: compare SWEEP {'--sort' if opts.sort else '--best'} KEY (one sweep alone)",
            code=2,
        )
    comparison, metrics = comparing.compare(
        [point for folder in folders for point in (point_dirs(folder) if is_sweep(folder) else [folder])], curves=bool(opts.html)
    )
    page = comparing.write_page(comparison, metrics, opts.html.resolve()) if opts.html else None
    if opts.json:
        print(json.dumps({**comparison.to_json(), "html": str(page) if page else None}, indent=2))
    else:
        print(comparing.render(comparison, page))
    return 0


LOGS_JSON_FOLLOW = "logs --json prints the logs once, as one object; follow them with logs -f (without --json)"


def logs(opts: argparse.Namespace) -> int:
    """logs: a run's job logs across requeues (-f: until it ends); a sweep's, point by point."""
    from ddpack.jobs import logs as job_logs

    run_dir = named_run(opts)
    if is_sweep(run_dir):
        return sweep_logs(opts, run_dir)
    if opts.json:
        if opts.follow:
            raise HostError(LOGS_JSON_FOLLOW, code=2)
        print(json.dumps({**facts(run_dir), "jobs": job_logs.log_lines(run_dir, opts.rank)}, indent=2))
        return 0
    if opts.follow:
        return job_logs.follow(run_dir, opts.rank)
    job_logs.print_logs(run_dir, opts.rank)
    return 0


def cancel(opts: argparse.Namespace) -> int:
    """cancel: scancel a run's job (a sweep's: every point still waiting or running); never a run not named."""
    from ddpack.jobs import run_actions
    from ddpack.jobs.find_runs import resolve_run

    if opts.run is None:  # what cannot be undone is never done to a run not named
        newest = resolve_run(None, runs_folder(opts))
        raise HostError(f"cancel names its run: the newest is {newest} (job {facts_of(newest)}); ddpack cancel {newest} cancels it", code=2)
    run_dir = named_run(opts)
    if is_sweep(run_dir):
        return sweep_cancel(opts, run_dir)
    job = run_actions.cancel(run_dir)
    say = f"cancel: job {job} of {run_dir} cancelled (scancel); ddpack status {run_dir} shows CANCELLED once Slurm has ended it"
    return answer(opts, run_dir, say, job_id=job)


def resubmit(opts: argparse.Namespace) -> int:
    """resubmit: a new job continuing a run with the same job script and image (a sweep: its failed points, one array)."""
    from ddpack.jobs import run_actions

    run_dir = named_run(opts)
    if is_sweep(run_dir):
        return sweep_resubmit(opts, run_dir)
    if opts.failed or opts.state:
        raise HostError(f"--failed and --state pick a sweep's points; {run_dir} is one run (resubmit it without them)", code=2)
    changes = changes_of(opts)
    job = run_actions.resubmit(run_dir, changes)
    changed = ", ".join(f"--{key.removesuffix('_limit')} {value}" for key, value in changes.items() if value is not None)
    say = f"resubmit: job {job} continues {run_dir} with the same image and job script{f' ({changed})' if changed else ''}"
    return answer(opts, run_dir, say, job_id=job)


def changes_of(opts: argparse.Namespace) -> dict[str, Any]:
    """What resubmit changes for the new job (None: as the run had it)."""
    return {"time_limit": opts.time_limit, "nodes": opts.nodes, "partition": opts.partition}


def remove(opts: argparse.Namespace) -> int:
    """rm: a run's or a sweep's folder deleted, once none of its jobs lives."""
    from ddpack.jobs import run_actions
    from ddpack.jobs.find_runs import resolve_run

    run_dir = resolve_run(opts.run, runs_folder(opts))
    jobs = run_actions.remove(run_dir)
    print(
        json.dumps({"run_dir": str(run_dir), "jobs": jobs}, indent=2)
        if opts.json
        else f"rm: removed {run_dir} (jobs {', '.join(jobs) or 'none'})"
    )
    return 0


def completion(opts: argparse.Namespace) -> int:
    """completion: the shell's completion script, made from this parser."""
    from ddpack.completion import script

    print(script(parser(), opts.shell), end="")
    return 0


def runs_folder(opts: argparse.Namespace) -> Path:
    """The runs folder a verb looks in: --runs, else DDPACK_RUNS, else the shared default (find_runs.default_runs)."""
    from ddpack.jobs.find_runs import default_runs

    return (opts.runs or default_runs()).resolve()


def named_run(opts: argparse.Namespace) -> Path:
    """The run folder (or sweep) a verb's RUN argument names under the runs folder; with --point, that point's."""
    from ddpack.jobs.find_runs import resolve_run

    return point_of(resolve_run(opts.run, runs_folder(opts)), getattr(opts, "point", None))


def facts(run_dir: Path) -> dict[str, Any]:
    """The names every verb's --json shares with status --json: run_dir, job_id, attempt, state."""
    from ddpack.jobs.status import run_status

    now = run_status(run_dir)
    return {"run_dir": now.run_dir, "job_id": now.job_id, "attempt": now.attempt, "state": now.state}


def answer(opts: argparse.Namespace, run_dir: Path, sentence: str, **extra: Any) -> int:
    """A verb's result: its sentence, or with --json one object of facts() and `extra`."""
    print(json.dumps({**facts(run_dir), **extra}, indent=2) if opts.json else sentence)
    return 0


# Every verb the parser knows, and what runs it: a verb is a parser entry (parser()) and a line here.
VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "submit": submit,
    "try": try_verb,
    "status": status,
    "logs": logs,
    "cancel": cancel,
    "ls": listing,
    "tag": tag,
    "resubmit": resubmit,
    "report": report,
    "compare": compare,
    "export": export,
    "halve": halve,
    "rm": remove,
    "gc": collect_images,
    "completion": completion,
}


if __name__ == "__main__":
    raise SystemExit(main())
