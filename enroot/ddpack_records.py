"""ddpack_records.py — what a job leaves in its run folder: the folder itself (made, checked, locked for one job), its
decisions (decisions.jsonl: what `ddpack status` reads), the run.json of a job started by hand, and the job's lines for
people beside them.

Standard library only, on the batch host (enroot/ddpack_job.py loads it). The names here are the run folder's contract
with the host (train/run_folder.py holds the same ones, and a test holds them together).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import socket
import sys
import time
from pathlib import Path

import ddpack_settings
from ddpack_node import JOB_ID, Refused, check_ancestors, not_yours_alone, one_line, warn, write_line, write_private
from ddpack_slurm import job_state

RUN_RECORD = "run.json"  # ddpack/jobs/run_json.py's file and format (its RunRecord and Job fields, format 1)
RECORD_FORMAT = 1
SECRET_SETTINGS = ("DDPACK_JOB_TOKEN",)  # never written to a record


LOCK = ".ddpack-lock"  # the run folder's lock file: the job holding it
MARKER = ".ddpack-this-start"  # touched at each start: forensics newer than it were written during this start
FAILURE_RESTARTS = ".ddpack-failure-restarts"  # the run folder's count of restarts after a failure, over its jobs
# train/run_folder.py's names (a test holds them to it)
FORENSICS, METRICS, SUMMARY, UNRESPONSIVE_NODES, REPORT = "forensics", "metrics.jsonl", "summary.json", "unresponsive-nodes", "report.html"
LOST_NODES = ".ddpack-lost-nodes"  # the nodes srun said failed in the step running now: the store task fences them


DECISIONS = "decisions.jsonl"  # ddpack/jobs/decisions.py reads it, for status and the ledger
DECISION_KINDS = ("start", "placement", "staging", "preflight", "step-end", "keep-out", "recovery")
VERDICTS = ("completed", "end", "requeue", "restart")  # a step-end's: what follows the step
RESERVED = ("time", "kind", "job", "slurm_job", "restart")  # every record's own fields, which no caller sets


def record_words(run_dir: Path, kind: str, words: list[str]) -> None:
    """The verb: one decision record from NAME=VALUE words (ddpack-job.sh's ddpack_record)."""
    fields: dict[str, object] = {}
    for pair in words:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[a-z_]+", name) or name in RESERVED:
            warn(f"record {kind}: {pair!r} is not NAME=VALUE of a field of its own; left out")
            continue
        fields[name] = value
    write_record(run_dir, kind, fields)


def write_record(run_dir: Path, kind: str, fields: dict[str, object]) -> None:
    """Append one decision record: time, kind, the job as ddpack knows it (a sweep's point as <array>_<index>) and as
    Slurm numbers it, the requeue count, and the fields given. One write of one line, to a file of this user's only
    (O_NOFOLLOW: never through a planted link); a failure is one warning line, never the job's end."""
    if kind == "step-end" and fields.get("verdict") not in VERDICTS:
        warn(f"record step-end: verdict {fields.get('verdict')!r} is not one of {', '.join(VERDICTS)}")
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    entry = {
        "time": time.time(), "kind": kind, "job": f"{array[0]}_{array[1]}" if all(array) else env.get("SLURM_JOB_ID"),
        "slurm_job": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
        **{name: value for name, value in fields.items() if name not in RESERVED},
    }  # fmt: skip
    try:
        fd = os.open(run_dir / DECISIONS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as why:
        warn(f"could not record the job's {kind} in {run_dir / DECISIONS}: {one_line(why)}")


def own_run_folder(run_dir: Path) -> None:
    """The run folder, made when missing (with its parents, under the job's umask), used only when it is this user's,
    not a link, and nobody else can write it or swap it (every folder above it root's or ours, sticky where others
    can write): another user's folder at a guessable runs/<name>-<job id> would get the job's snapshots and plant
    what the job reads back."""
    if not run_dir.is_absolute():
        raise Refused("is not an absolute path")
    with contextlib.suppress(FileExistsError):
        run_dir.mkdir(parents=True)
    if (problem := not_yours_alone(run_dir, "folder")) is not None:
        raise Refused(f"{problem}; give this job a run folder of your own")
    check_ancestors(run_dir)


@contextlib.contextmanager
def guard(path: Path):  # type: ignore[no-untyped-def]
    """An exclusive lock around a run lock's read and write, so two jobs starting at once cannot both take it: an
    flock, or where the filesystem has none (an NFS or Lustre mount without flock), a guard file made with O_EXCL,
    waited for up to a minute (one older than that was left by a killed job and is taken over)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        with exclusive_file(path.with_name(path.name + ".excl")):
            yield
        return
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_file(path: Path, wait_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            break
        except FileExistsError:
            if time.monotonic() > deadline:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                deadline = time.monotonic() + wait_s
            time.sleep(0.1)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def give_back_run_folder(run_dir: Path, job: str) -> None:
    """Give the run folder back when this job leaves it for good (not on a requeue)."""
    path = run_dir / LOCK
    with contextlib.suppress(OSError):
        if read_nofollow(path).split()[:1] == [job]:
            os.unlink(path)


def user_name() -> str:
    """This user's name from the password database (a batch job's environment may carry no USER), else the uid."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def read_nofollow(path: Path, limit: int | None = 4096) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as handle:
        return handle.read(limit) if limit is not None else handle.read()


def take_run_folder(run_dir: Path, job: str, *, log: str, script: str) -> None:
    """Take the run folder for job `job`: its lock file names the job holding it. A requeue of the holder (same job id)
    continues; a live other job is refused in one line; a holder Slurm no longer lists left it behind (scancelled, timed
    out) and is replaced. An squeue that fails refuses: a folder in use is never shared. `log` and `script` (Slurm's
    StdOut and Command, read by the caller) go into the run.json of a job started by hand."""
    try:
        own_run_folder(run_dir)
    except (Refused, OSError) as why:
        die(f"DDPACK_RUN_DIR={run_dir}: {one_line(why)}")
    path = run_dir / LOCK
    me = f"{job} {user_name()} {socket.gethostname()} {int(time.time())}\n"
    with guard(run_dir / f"{LOCK}.guard"):
        try:
            holder_line = read_nofollow(path)
        except FileNotFoundError:
            holder_line = ""
        holder = holder_line.split()[0] if holder_line.split() else ""
        if holder and holder != job:
            state = job_state(holder) if JOB_ID.fullmatch(holder) else ""
            if state is None:
                die(f"the run folder {run_dir} is held by job {holder} and squeue cannot say whether it is over; try again")
            if state:
                die(
                    f"the run folder {run_dir} is in use by job {holder} ({state}, {' '.join(holder_line.split()[1:2])}); "
                    f"wait for it to end, scancel {holder}, or give this job another DDPACK_RUN_DIR"
                )
        write_private(path, me)
    try:
        record_hand_made(run_dir, job, dict(os.environ), log=log, script=script)
    except (OSError, Refused) as why:  # the run goes on; only ddpack's view of it is missing
        warn(f"could not write {run_dir / RUN_RECORD} for `ddpack status/logs/cancel {job}`: {one_line(why)}")


def record_hand_made(run_dir: Path, job: str, environ: dict[str, str], *, log: str, script: str) -> None:
    """A run.json for a job started by hand with a template (sbatch enroot/...): the job, its log and script (Slurm's
    StdOut and Command, read before the record's lock, never inside it), its settings and command, so `ddpack status`,
    `logs` and `cancel` know it. A run `ddpack submit` made is left alone (it lists its jobs itself); a hand-made run a
    later job continues (DDPACK_RUN_DIR) gets that job appended. Written as ddpack writes it: under the record's flock,
    through a private name and a rename."""
    path = run_dir / RUN_RECORD
    with guard(run_dir / f".{RUN_RECORD}.lock"):
        try:
            data = json.loads(read_nofollow(path, limit=None))
        except FileNotFoundError:
            data = None
        except (OSError, ValueError):
            return  # a record ddpack cannot read is left as it is: `ddpack status` names the problem
        now = time.time()
        entry = {"job_id": job, "attempt": 1, "submitted": now, "how": "template", "changes": {}, "log": log or None}
        if data is not None:
            jobs = data.get("jobs") or []
            if not jobs or jobs[0].get("how") != "template" or any(j.get("job_id") == job for j in jobs):
                return
            data["jobs"] = [*jobs, {**entry, "attempt": len(jobs) + 1}]
        else:
            script_path = Path(script)
            try:
                digest = hashlib.sha256(script_path.read_bytes()).hexdigest() if script_path.is_absolute() else ""
            except OSError:
                digest = ""
            settings = {k: v for k, v in environ.items() if k.startswith("DDPACK_") and k not in SECRET_SETTINGS}
            try:
                command = json.loads(environ.get("DDPACK_COMMAND") or "[]")
            except ValueError:
                command = []
            data = {
                "format": RECORD_FORMAT, "name": run_dir.name, "run_dir": str(run_dir), "created": now, "user": user_name(),
                "host": socket.gethostname(), "image": {"ref": None, "image_id": None, "note": "a job started by hand with a template"},
                "sqsh": {"path": environ.get("DDPACK_SQSH")}, "code": {}, "command": command if isinstance(command, list) else [],
                "settings": {"made_by": "template", "exported": settings}, "script": os.path.relpath(script_path, run_dir) if digest else "",
                "script_sha256": digest, "versions": {}, "jobs": [entry], "events": [], "environment": {}, "run_file": None, "sweep": None,
            }  # fmt: skip
        write_private(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def say(text: str) -> None:
    """A line of the job's log for people (stdout, as the shell's echo); a log that cannot be written (a full disk) costs
    the line, never the decision it tells of."""
    write_line(sys.stdout, f"ddpack: {text}")


def job_error(run_dir: Path | None, text: str) -> None:
    """Bad input found by the job: one line, recorded as the job's end once it has a run folder (ddpack-job.sh's
    ddpack_die), exit 2."""
    if run_dir is not None and run_dir.is_dir():
        write_record(run_dir, "step-end", {"verdict": "end", "reason": "bad-input", "exit": "2", "text": f"error: {text}"})
    die(text)


def checked_settings(run_dir: Path, names: tuple[str, ...]) -> dict[str, str]:
    """`names` as the job sees them (the settings table's defaults where unset). A value the table refuses ends the
    job with its line: ddpack_setup checked every setting already, this is for a script that skipped it."""
    env = os.environ
    for why in ddpack_settings.problems({name: env[name] for name in names if name in env}):
        job_error(run_dir, why)
    return {name: ddpack_settings.value(name, env) for name in names}


def die(text: str) -> None:
    print(f"ddpack: error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(2)
