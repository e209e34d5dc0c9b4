"""ddpack_job.py — a ddpack job's one program on its batch host: the verb table the templates call, and the job's start.

Run by enroot/ddpack-job.sh with the host's python3 (standard library only, `python3 -I -S ddpack_job.py VERB ...`), as
the job's user. Its concerns live beside it, each a file (all of them are the job's, installed and copied together):

    ddpack_job.py       this table, the start (settings, run folder, banner) and the verbs' answers to the shell
    ddpack_staging.py   the image on the nodes: DDPACK_STAGE's choice, sbcast
    ddpack_training.py  the training step, a restart in place, the job's end or its requeue
    ddpack_step.py      one step's srun, its output read as it comes: tasks ended, nodes failed, end records
    ddpack_step_records.py  what the step wrote to the metrics file: progress, a fallback, recoveries and their hosts
    ddpack_records.py   the run folder, its lock, decisions.jsonl, a hand-made run.json, the lines for people
    ddpack_slurm.py     what the job asks Slurm, once a decision (JobFacts), and the one shape of a step on each node
    ddpack_node.py      what a node runs, and the only text a node is sent (prepare, receive, install)
    ddpack_settings.py  the table of every DDPACK_* setting: pattern, default, meaning

The verbs (a verb that answers hands the shell its answer one way: on the fd ddpack_ask opens, else on stdout):

    setup NAME                every setting checked, the run folder chosen, made and locked for this job, the banner;
                              answers the run folder
    cpus-per-task             answers each task's share of its node's CPUs ("" when srun's own choice stands)
    words SETTING             answers a command setting's words (or COMMAND: what the training step runs), shell-quoted
    container-path PATH       answers PATH as the container sees it through DDPACK_MOUNTS, or one line, exit 2
    project-dir [container]   answers where --task modules are imported from
    stage [--container NAME] SQSH
                              DDPACK_STAGE's choice carried out; answers the path each node's pyxis imports (a node that
                              could not stage gets container NAME made from SQSH, the shared file, alone)
    preflight [--container NAME] -- STEP...
                              DDPACK_PREFLIGHT=1|only: the template's step with `entrypoint --preflight`, first; a
                              node that fails only node checks is swapped for a spare (DDPACK_SPARE_NODES), else the
                              job ends naming it
    train [--container NAME] --step-words N -- STEP(N words)... COMMAND...
                              the training step, restarted in place while it can, then the job's end or its requeue
    leave [--container NAME]  the job's container leaves the nodes, and the run folder is given back
    remove-container --container NAME
                              the job's container leaves the nodes
    record RUN_DIR KIND K=V.. one decision appended to RUN_DIR/decisions.jsonl (what `ddpack status` reads)
    lock RUN_DIR --job J      take the run folder for job J, or refuse naming the live job that holds it;
    unlock RUN_DIR --job J    give it back
    key SQSH                  answers the staging key of a squashfs: its content's (make sqsh's record) or its file's
    image-ok SQSH             refuse a squashfs other users could replace (writable by them, or in a folder they can)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Its concerns, loaded from beside this file (python3 -I puts no script folder on sys.path; the host's ddpack has put it
# there already when it loads one of them: ddpack/job_side.py).
if (HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.insert(0, HERE)
# Python keeps its compiled modules in __pycache__/ beside them where it may write (a run folder's job/, a checkout): a
# verb then compiles this file alone, not all the rest, each of the job's dozen calls.
try:
    import ddpack_settings
    from ddpack_records import (
        DECISION_KINDS,
        MARKER,
        die,
        give_back_run_folder,
        job_error,
        record_words,
        say,
        take_run_folder,
        write_record,
    )
    from ddpack_settings import container_path, value
    from ddpack_slurm import JobFacts, command
    from ddpack_staging import Staging, check_image, image_key
    from ddpack_training import Training, newer, remove_container
except ImportError as missing:
    print(f"ddpack: error: cannot read {missing.name}.py beside {__file__}; set DDPACK_HOME to ddpack's enroot/ folder", file=sys.stderr)
    raise SystemExit(2) from None

# --------------------------------------------------------------------------- the start: settings, run folder, banner


def setup(name: str) -> int:
    """The job's start (ddpack-job.sh's ddpack_setup, under the job's umask): every DDPACK_* value against the settings
    table, before anything is touched (one line each, exit 2); the job's log narrowed to the umask's mode; the run
    folder chosen, made and locked for this job; the start marked, said in the banner and recorded. The run folder is
    the answer (stdout); the lines for people go to stderr.

    Run folders: one run, one folder. A new submission gets runs/<job name>-<job id> in the submission folder; a requeue
    keeps its job id and so continues its own folder; to continue an earlier run in a new job, name its folder with
    DDPACK_RUN_DIR (the banner prints the line to use). Two jobs submitted from one folder never resume each other's
    snapshots."""
    env = os.environ
    found = ddpack_settings.problems(env)
    for why in found:
        print(f"ddpack: error: {why}", file=sys.stderr)
    if found:
        return 2
    job, restart = env["SLURM_JOB_ID"], int(env.get("SLURM_RESTART_COUNT") or 0)
    facts = JobFacts(job)  # the start's one `scontrol show job`: its log and script
    private_log(facts)
    if env.get("DDPACK_RUN_DIR"):
        run_dir = Path(env["DDPACK_RUN_DIR"])
        origin = f"continuing {run_dir} (DDPACK_RUN_DIR)"
        if not (run_dir / MARKER).exists():
            origin = f"new run in {run_dir} (DDPACK_RUN_DIR); a requeue continues it"
    else:
        run_dir = Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd()) / "runs" / f"{name}-{job}"
        origin = "requeued: continuing its run from the last snapshot"
        if not restart:
            origin = f"new run; a requeue continues it; to continue it in another job: sbatch --export=ALL,DDPACK_RUN_DIR={run_dir} ..."
    # Made here when missing, then used only when it is this user's (not a link, nobody else can write or swap it), and
    # only by this job while it lives: another live job that names it is refused, naming the holder.
    with for_people():
        take_run_folder(run_dir, job, log=facts.field("StdOut"), script=facts.field("Command"))
        (run_dir / MARKER).open("w").close()  # forensics newer than this were written during this start
        # The time closes the line: `ddpack status` dates the segment this start begins, for a program that writes no records.
        nodes = env.get("SLURM_JOB_NODELIST", "")
        log_at = log_offset()
        say(f"job {job} (restart {restart}) on {nodes}, run dir {run_dir} ({origin}), at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
    write_record(run_dir, "start", {"nodes": nodes, "origin": origin, **({"log_at": log_at} if log_at is not None else {})})
    answer(str(run_dir))
    return 0


def log_offset() -> int | None:
    """Where this start begins in the job's log (stdout, when Slurm made it a file): `ddpack status` places Slurm's own
    cancel line, which no record of the job's can hold, after the start it ended by this offset, not by a clock (Slurm
    writes the cluster's local time) nor by a sentence of the log."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        info = os.fstat(sys.stdout.fileno())
        return info.st_size if stat.S_ISREG(info.st_mode) else None
    return None


def private_log(facts: JobFacts) -> None:
    """The job's log, opened by Slurm before the script ran with the umask sbatch was called under, narrowed to the
    job's own umask (DDPACK_UMASK: what the job writes is its user's alone, or its group's too)."""
    mask = os.umask(0)
    os.umask(mask)
    for log in {facts.field("StdOut"), facts.field("StdErr")} - {""}:
        with contextlib.suppress(OSError):  # another user's file cannot be changed (EPERM); a link is never followed
            if stat.S_ISREG(os.lstat(log).st_mode):
                os.chmod(log, 0o666 & ~mask)


def cpus_per_task() -> int:
    """The verb: each task's share of its node's CPUs, for a one-task-per-GPU step (answered; nothing when srun's own
    choice stands). srun (Slurm 22.05 and later) does not inherit the job's --cpus-per-task, and without one each task
    may be bound to a single CPU: 8 GPU ranks and their DataLoader workers on 8 cores of a 96-core node. srun reads
    SRUN_CPUS_PER_TASK: the job's --cpus-per-task when it gave one, else the node's CPUs divided among its tasks. A
    value the job set itself stands."""
    env = os.environ
    cpus, tasks, given = env.get("SLURM_CPUS_ON_NODE", ""), env.get("SLURM_NTASKS_PER_NODE", ""), env.get("SLURM_CPUS_PER_TASK", "")
    share = 0
    if not env.get("SRUN_CPUS_PER_TASK"):
        if re.fullmatch(r"[0-9]+", given):
            share = int(given)
        elif re.fullmatch(r"[0-9]+", cpus) and re.fullmatch(r"[0-9]+", tasks) and int(tasks) > 0:
            share = int(cpus) // int(tasks)
    if share > 1:
        with for_people():
            say(f"each task gets {share} CPUs (SRUN_CPUS_PER_TASK; set it to choose)")
    answer(str(share) if share > 1 else "")
    return 0


def words(name: str) -> int:
    """The words of a command setting (DDPACK_TRAIN_ARGS, DDPACK_PREFLIGHT_ARGS, DDPACK_LAUNCH_ARGS), or with COMMAND
    what the training step runs after the entrypoint: `--` and DDPACK_COMMAND's words (your own program), else
    DDPACK_TRAIN_ARGS's (the bundled trainer's flags), else nothing (the image's own command or the bundled trainer).
    Answered shell-quoted, for the template's array: a value that starts with [ is a JSON list of strings, each word exactly as
    given (spaces, quotes, backslashes, empty words: what `ddpack submit -- CMD` writes); any other value is split on
    whitespace, the hand-made form. A value that is neither is one line (the settings table's), exit 2."""
    env = os.environ
    prefix: list[str] = []
    if name == "COMMAND":
        if env.get("DDPACK_COMMAND") and env.get("DDPACK_TRAIN_ARGS"):
            job_error(
                Path(env["DDPACK_RUN_DIR"]) if env.get("DDPACK_RUN_DIR") else None,
                "DDPACK_COMMAND and DDPACK_TRAIN_ARGS are both set; DDPACK_TRAIN_ARGS is for the bundled trainer: "
                "put your program's arguments in DDPACK_COMMAND",
            )
        if env.get("DDPACK_COMMAND") and value("DDPACK_STANDBYS", env) != "auto" and int(value("DDPACK_STANDBYS", env)):
            job_error(
                Path(env["DDPACK_RUN_DIR"]) if env.get("DDPACK_RUN_DIR") else None,
                f"DDPACK_STANDBYS={env['DDPACK_STANDBYS']} starts standbys of the bundled trainer, which DDPACK_COMMAND does not run: "
                "unset DDPACK_STANDBYS, or train with the bundled trainer (DDPACK_TRAIN_ARGS)",
            )
        name, prefix = ("DDPACK_COMMAND", ["--"]) if env.get("DDPACK_COMMAND") else ("DDPACK_TRAIN_ARGS", [])
    text = env.get(name, "")
    setting = ddpack_settings.SETTINGS.get(name)
    if setting is not None and (why := setting.problem(name, text)) is not None:
        die(why)
    answer(" ".join(shlex.quote(word) for word in [*prefix, *ddpack_settings.command_words(text)]))
    return 0


def container_path_verb(path: str) -> int:
    """The verb: the path inside the container, or one line (recorded as the job's end once it has a run folder)."""
    mounts = os.environ.get("DDPACK_MOUNTS", "")
    inside = container_path(path, mounts)
    if inside is None:
        run_dir = os.environ.get("DDPACK_RUN_DIR")
        job_error(
            Path(run_dir) if run_dir else None,
            f"{path} is not under any of DDPACK_MOUNTS={mounts} (host:container pairs), so the container cannot reach it; submit "
            "from a folder on a mounted filesystem or add its mount to DDPACK_MOUNTS",
        )
    answer(inside)
    return 0


def project_dir(where: str) -> int:
    """Where the trainer imports `--task module:factory` from after its working directory: DDPACK_PROJECT_DIR as given,
    else the submission folder; with `container`, as the container sees it (nothing, and one line, when no mount holds
    it: the modules are then looked for in the run folder only)."""
    env = os.environ
    folder = env.get("DDPACK_PROJECT_DIR") or env.get("SLURM_SUBMIT_DIR", "")
    if where == "container":
        inside = container_path(folder, env.get("DDPACK_MOUNTS", ""))
        if inside is None:
            with for_people():
                say(
                    f"{folder} is under none of DDPACK_MOUNTS={env.get('DDPACK_MOUNTS', '')}: --task modules are looked for in the run folder only"
                )
        folder = inside or ""
    answer(folder)
    return 0


# The fields of a failed node check the job keeps (train/preflight/verdict.py NodeCheck.key: a test holds them together).
NODE_CHECK_FIELDS = ("node", "check", "value", "threshold", "device")


def failed_node_checks(report: Path) -> tuple[list[dict[str, str]], int]:
    """The failing node checks of a preflight's report (preflight.json's node_checks), and how many of its failures are
    not node checks: the preflight puts each failing row's line among its failures once (train/preflight/__main__.py
    run_checks), so the rest is the count of the others (identity, sums, storage, ...). ([], 0) where it has none; ([],
    1) where it cannot be read (the preflight ended before writing it): that failure is not a node's."""
    try:
        record = json.loads(report.read_text())
        rows = [row for row in record.get("node_checks") or [] if row.get("status") == "fail"]
        failed = [{name: str(row.get(name, "")) for name in NODE_CHECK_FIELDS} for row in rows]
        return failed, len(record.get("failures") or []) - len(failed)
    except (OSError, ValueError, AttributeError, TypeError):
        return [], 1


def preflight(container: str, argv: list[str]) -> int:
    """The verb: `preflight [--container NAME] -- STEP...`. DDPACK_PREFLIGHT=1 runs the template's own srun line with
    `entrypoint --preflight` as a step before training, over the whole allocation (spares included: every node that
    may train is checked once). A node that fails only node checks (every failure the report holds is one) is swapped
    for a spare when DDPACK_SPARE_NODES covers it: one line and the `preflight` record (result `swapped`) name it, the
    check and the value, and training starts on the others in this job, the node kept out of its restarts and of a
    requeue (`Training.swap_out`, the placement every restart uses). Any other failure, or too few spares, ends the job
    with the preflight's code (the container leaves the nodes), naming the nodes. DDPACK_PREFLIGHT=only: the check alone
    (enroot/preflight.sbatch, which the shell ends after it): nothing is swapped."""
    env = os.environ
    mode = value("DDPACK_PREFLIGHT", env)
    if mode == "0":
        return 0
    run_dir, job = Path(env["DDPACK_RUN_DIR"]), env["SLURM_JOB_ID"]
    report = run_dir / "preflight.json"
    say(f"preflight (DDPACK_PREFLIGHT={mode}): checking the job in its own image, plan and network first")
    code = command(argv).returncode
    rc = 128 - code if code < 0 else code
    if rc:
        # A report older than this start is an earlier start's: nothing in it is about these nodes now.
        failed, others = failed_node_checks(report) if newer(report, run_dir / MARKER) else ([], 1)
        nodes = list(dict.fromkeys(check["node"] for check in failed))
        on = "".join(f" on node {node} ({', '.join(dict.fromkeys(c['check'] for c in failed if c['node'] == node))})" for node in nodes)
        fields: dict[str, object] = {"result": "failed", "exit": str(rc), "report": str(report)}
        if failed:  # fields, not a sentence: what a swap for a spare node reads
            fields.update(nodes=nodes, failed_checks=failed)
        not_swapped = ""
        if rc == 1 and failed and not others and mode == "1":
            training = Training([], [], container)
            if training.swap_out(nodes):
                checks = "; ".join(
                    f"{c['check']}{' ' + c['device'] if c['device'] else ''}: {c['value']} (threshold {c['threshold']})" for c in failed
                )
                say(
                    f"preflight failed{on}: {checks}; swapped for a spare: training on {','.join(training.last_nodes)} in this job, "
                    f"without {','.join(nodes)} here and in its restarts (DDPACK_SPARE_NODES={training.spares})"
                )
                write_record(run_dir, "preflight", {**fields, "result": "swapped", "training": ",".join(training.last_nodes)})
                return 0
            not_swapped = f" ({training.short})"
            fields["swap"] = training.short
        if container:
            remove_container(JobFacts(job), container)
        say(
            f"preflight failed (exit {rc}){on}; not training{not_swapped}. The 'preflight: FAIL' lines above name each problem; the report is {report}"
        )
        write_record(run_dir, "preflight", fields)
        return rc
    write_record(run_dir, "preflight", {"result": "passed", "exit": "0", "report": str(report)})
    if mode == "only":
        say(f"preflight passed; report {report}")
    return 0


ANSWER_FD = os.environ.pop("ddpack_answer_fd", None)  # ddpack-job.sh's ddpack_ask: the fd a verb's answer goes to


def answer(text: str) -> None:
    """A verb's answer, which the shell captures: on the fd ddpack_ask opened for it (the verb's lines for people stay on
    stdout, in the job's log with the rest), else on stdout (its lines for people then go to stderr: for_people)."""
    if ANSWER_FD:
        os.write(int(ANSWER_FD), os.fsencode(text) + b"\n")
    else:
        print(text, flush=True)


def for_people() -> contextlib.AbstractContextManager:
    """Where a verb with an answer says its lines for people: stdout when the answer has its own fd, else stderr."""
    return contextlib.nullcontext() if ANSWER_FD else contextlib.redirect_stdout(sys.stderr)


def restore_locale() -> None:
    """Python coerces a C locale to C.UTF-8 and exports LC_CTYPE (PEP 538; -I cannot turn that off): the steps this
    program starts get LC_CTYPE as the job's shell had it (ddpack-job.sh passes it as ddpack_lc_ctype)."""
    was = os.environ.pop("ddpack_lc_ctype", None)
    if was == "(unset)":
        os.environ.pop("LC_CTYPE", None)
    elif was is not None:
        os.environ["LC_CTYPE"] = was


def stage(sqsh: str, container: str) -> int:
    """The verb: answer the path each node's pyxis imports; the choice is said for people."""
    with for_people():
        image = Staging(sqsh, Path(os.environ["DDPACK_RUN_DIR"]), JobFacts(os.environ["SLURM_JOB_ID"]), container).choose()
    answer(image)
    return 0


def train(container: str, step_words: int, argv: list[str], *, tasks_are_ranks: bool = True) -> int:
    """The verb: the step's srun and its options (`step_words` words) come first, the placement goes between them and
    the command. Ends with the last step's status. `tasks_are_ranks` False: a template whose task starts a node's ranks
    (torchrun's agent, a docker run), where no task can be a standby."""
    if step_words > len(argv):
        die(f"train: --step-words {step_words} is more than the {len(argv)} words given")
    return Training(argv[:step_words], argv[step_words:], container, tasks_are_ranks=tasks_are_ranks).run()


def leave(container: str) -> int:
    """The verb: the job's container leaves the nodes (a script that trains no step), and the run folder is free."""
    job = os.environ["SLURM_JOB_ID"]
    if container:
        remove_container(JobFacts(job), container)
    give_back_run_folder(Path(os.environ["DDPACK_RUN_DIR"]), job)
    return 0


# --------------------------------------------------------------------------- the verb table


def verb_table() -> dict[str, tuple[Callable[[argparse.Namespace, list[str]], int], argparse.ArgumentParser]]:
    """Every verb: what runs it and the one parse of its options. A verb that runs a step takes the step's words after
    `--`, exactly as given (they are never parsed as options of ours)."""
    table: dict[str, tuple[Callable[[argparse.Namespace, list[str]], int], argparse.ArgumentParser]] = {}

    def verb(name: str, run: Callable[[argparse.Namespace, list[str]], int], *arguments: tuple[tuple[str, ...], dict]) -> None:
        parser = argparse.ArgumentParser(prog=f"ddpack_job.py {name}")
        for flags, options in arguments:
            parser.add_argument(*flags, **options)
        table[name] = (run, parser)

    container = (("--container",), {"default": "", "help": "the job's named container (pyxis templates)"})
    sqsh = (("sqsh",), {})
    run_dir = (("run_dir",), {"type": Path})
    job = (("--job",), {"required": True})
    verb("setup", lambda a, _: setup(a.name), (("name",), {}))
    verb("cpus-per-task", lambda a, _: cpus_per_task())
    verb("words", lambda a, _: words(a.setting), (("setting",), {}))
    verb("container-path", lambda a, _: container_path_verb(a.path), (("path",), {}))
    verb("project-dir", lambda a, _: project_dir(a.where), (("where",), {"nargs": "?", "default": "", "choices": ("", "container")}))
    verb("stage", lambda a, _: stage(a.sqsh, a.container), sqsh, container)
    verb("preflight", lambda a, words: preflight(a.container, words), container)
    verb("train", lambda a, words: train(a.container, a.step_words, words, tasks_are_ranks=not a.tasks_not_ranks), container,
         (("--step-words",), {"type": int, "required": True}), (("--tasks-not-ranks",), {"action": "store_true"}))  # fmt: skip
    verb("leave", lambda a, _: leave(a.container), container)
    verb("remove-container", lambda a, _: remove_container(JobFacts(os.environ["SLURM_JOB_ID"]), a.container) or 0, container)
    verb("record", lambda a, _: record_words(a.run_dir, a.kind, a.fields) or 0, run_dir, (("kind",), {"choices": DECISION_KINDS}),
         (("fields",), {"nargs": "*"}))  # fmt: skip
    verb("lock", lambda a, _: lock_verb(a.run_dir, a.job), run_dir, job)
    verb("unlock", lambda a, _: give_back_run_folder(a.run_dir, a.job) or 0, run_dir, job)
    verb("key", lambda a, _: answer(image_key(Path(a.sqsh))) or 0, sqsh)
    verb("image-ok", lambda a, _: check_image(a.sqsh) or 0, sqsh)
    return table


STEP_VERBS = ("preflight", "train")  # the verbs that take a step's words after `--`


def lock_verb(run_dir: Path, job: str) -> int:
    """The verb: take the run folder for `job` (its log and script as Slurm names them, for a hand-made run.json)."""
    facts = JobFacts(job)
    take_run_folder(run_dir, job, log=facts.field("StdOut"), script=facts.field("Command"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    restore_locale()
    table = verb_table()
    if not argv or argv[0] not in table:
        die(f"{argv[0] if argv else 'no verb'}: expected one of {', '.join(table)} (see enroot/ddpack_job.py's docstring)")
    run, parser = table[argv[0]]
    options, words = argv[1:], []
    if argv[0] in STEP_VERBS and "--" in options:
        at = options.index("--")
        options, words = options[:at], options[at + 1 :]
    return run(parser.parse_args(options), words)


if __name__ == "__main__":
    sys.exit(main())
