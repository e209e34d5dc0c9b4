"""Finding a run and acting on it: `ddpack logs`, `cancel` and `resubmit`, over the run folder `ddpack submit` made.

A run is named by its folder, by one of its job ids, or by nothing (the newest run under the runs folder). Its jobs'
logs are `logs/slurm-<job>.out` in the folder (a requeue appends to its job's log; a resubmit is a new job and a new
log), so `logs` shows a run's whole history and `logs -f` follows it across requeues, ending with the job's status.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ddpack.errors import HostError
from ddpack.job_side import module
from ddpack.jobs import slurm_cli
from ddpack.jobs.run_record import append_event, not_a_run_of_yours, read_record
from ddpack.jobs.slurm_cli import ENDED, EXIT_FOR_STATE
from ddpack.jobs.status import list_runs, run_status

POLL_STATE_S = 2.0  # how often `logs -f` asks Slurm for the job's state (the log itself is read every poll)


# Where runs live when neither --runs nor DDPACK_RUNS says: the user's own folder on the shared filesystem, the same
# from every folder the command is typed in and on every login node (a relative ./runs found nothing from elsewhere).
SHARED_RUNS = "/fsx/{user}/ddpack-runs"


def default_runs() -> Path:
    """DDPACK_RUNS, else SHARED_RUNS for this user (named from the password database: a batch job may have no USER;
    a user the database does not know, as in some containers, by USER, else the uid)."""
    if os.environ.get("DDPACK_RUNS"):
        return Path(os.environ["DDPACK_RUNS"])
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = os.environ.get("USER") or str(os.geteuid())
    return Path(SHARED_RUNS.format(user=user))


def resolve_run(run: str | None, runs: Path) -> Path:
    """The run folder `run` names: a run folder or a sweep's, a job id of a run under `runs` (a sweep's point is
    `<array>_<index>`, the whole sweep the array's id), or (None) the newest run or sweep there."""
    from ddpack.jobs.sweep import is_sweep, list_sweeps, read_sweep

    if run is None:
        newest = [*((record.created, folder) for folder, record in list_runs(runs) if record.sweep is None),
                  *((data.get("created", 0), folder) for folder, data in list_sweeps(runs))]  # fmt: skip
        if not newest:
            raise HostError(f"no runs under {runs}: submit one (ddpack submit), or name its folder (--runs DIR, or DDPACK_RUNS)", code=2)
        return max(newest, key=lambda item: item[0])[1]
    path = Path(run)
    if path.is_dir():
        if is_sweep(path):
            read_sweep(path)  # a one-line error when it is not the user's own
        else:
            read_record(path)  # a one-line error when it is not a run folder
        return path.resolve()
    if re.fullmatch(r"\d+(_\d+)?", run):
        # The runs folder, then ./runs: where a job started by hand with a template keeps its run (runs/<name>-<job>
        # in the folder it was submitted from), so `ddpack status JOB` typed there finds it.
        for where in dict.fromkeys([runs, (Path.cwd() / "runs").resolve()]):
            # Slurm reuses job ids (a new cluster, a reset): the newest run or sweep that has it, whichever it is.
            having = [*((record.created, folder) for folder, record in list_runs(where) if any(job.job_id == run for job in record.jobs)),
                      *((data.get("created", 0), folder) for folder, data in list_sweeps(where) if str(data.get("job_id")) == run)]  # fmt: skip
            if having:
                return max(having, key=lambda item: item[0])[1]
        raise HostError(f"job {run} belongs to no run under {runs} or ./runs; name the run folder, or give --runs", code=2)
    raise HostError(f"{run} is neither a run folder nor a job id", code=2)


# --------------------------------------------------------------------------- logs


# srun --label's prefix (the per-task template labels a program of your own): the task number, right-aligned.
SRUN_LABEL = re.compile(r"^\s*(\d+): ")


def rank_filter(line: str, rank: int | None) -> bool:
    """Rank `rank`'s line: the bundled trainer's "[rank R/W]", or srun's "R: " label on any program's."""
    if rank is None or line.startswith(f"[rank {rank}/") or f"] [rank {rank}/" in line:
        return True
    label = SRUN_LABEL.match(line)
    return label is not None and int(label.group(1)) == rank


def whole_lines(log: Path) -> tuple[list[str], int]:
    """A log's whole lines (a line still being written is shown once it is whole) and their length in bytes."""
    data = log.read_bytes() if log.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    return complete.decode(errors="replace").splitlines(keepends=True), len(complete)


def log_lines(run_dir: Path, rank: int | None) -> list[dict[str, object]]:
    """Each job's whole lines (rank `rank`'s alone, when given), in submission order: what `logs --json` prints."""
    jobs = []
    for job in read_record(run_dir).jobs:
        log = job.log_path(run_dir)
        lines = [line.rstrip("\n") for line in whole_lines(log)[0] if rank_filter(line, rank)]
        jobs.append({"job_id": job.job_id, "attempt": job.attempt, "how": job.how, "log": str(log), "lines": lines})
    return jobs


def print_logs(run_dir: Path, rank: int | None, out: TextIO | None = None) -> dict[str, int]:
    """Every job's log in submission order (to `out`, else this moment's stdout); {log: bytes shown}, where a follow
    goes on from."""
    out = out or sys.stdout
    record = read_record(run_dir)
    shown = {}
    for job in record.jobs:
        log = job.log_path(run_dir)
        if len(record.jobs) > 1:
            out.write(f"==> job {job.job_id} (attempt {job.attempt}, {job.how}) <==\n")
        lines, size = whole_lines(log)
        out.writelines(line for line in lines if rank_filter(line, rank))
        shown[str(log)] = size
    out.flush()
    return shown


def follow(run_dir: Path, rank: int | None, out: TextIO | None = None, poll_s: float = 0.5, settle_s: float | None = None) -> int:
    """Show the logs, then follow the newest job's until the job has ended (an ended state that held `settle_s`,
    slurm_cli.SETTLE_S: across its requeues); returns 0 when it COMPLETED, else the state's exit status (EXIT_FOR_STATE)."""
    settle_s = slurm_cli.SETTLE_S if settle_s is None else settle_s
    out = out or sys.stdout
    shown = print_logs(run_dir, rank, out)
    record = read_record(run_dir)
    job = record.last_job
    if job is None:
        raise HostError(f"{run_dir} has no job to follow", code=2)
    log = job.log_path(run_dir)
    offset, ended_since, next_check, state = shown.get(str(log), 0), None, 0.0, ""
    while True:
        if log.exists() and log.stat().st_size > offset:
            with log.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
            complete = data[: data.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.decode(errors="replace").splitlines(keepends=True):
                if rank_filter(line, rank):
                    out.write(line)
            out.flush()
        now = time.monotonic()
        if now >= next_check:
            state = run_status(run_dir).state
            next_check = now + POLL_STATE_S
            ended_since = (ended_since or now) if state in ENDED else None
        if ended_since is not None and now - ended_since >= settle_s:
            out.write(f"ddpack logs: job {job.job_id} {state}\n")
            out.flush()
            return EXIT_FOR_STATE.get(state, 1)
        time.sleep(poll_s)


# --------------------------------------------------------------------------- cancel and resubmit


def cancel(run_dir: Path) -> str:
    """scancel the run's newest job (a requeue keeps its id, so the run stops for good); recorded in run.json."""
    record = read_record(run_dir)
    job = record.last_job
    if job is None:
        raise HostError(f"{run_dir} has no job to cancel", code=2)
    queue = slurm_cli.queue_state(job.job_id)
    if queue.failed:
        raise HostError(f"cannot tell whether job {job.job_id} of this run still lives: {queue.failed}; try again", code=2)
    if not queue.listed or queue.state in slurm_cli.FINAL:
        raise HostError(f"job {job.job_id}, this run's newest, has ended ({queue.state or 'Slurm no longer lists it'}); nothing to cancel", code=2)
    slurm_cli.scancel(job.job_id)
    append_event(run_dir, {"kind": "cancel", "job_id": job.job_id})
    return job.job_id


def resubmit(run_dir: Path, changes: dict[str, Any] | None = None) -> str:
    """A new job that continues the run folder with the same job script and the same image; refused in one line
    when that image is gone or changed, the script was edited, a job of the run still lives, or a secret it was given
    is not in this shell. `changes` (time_limit, nodes, partition) override the script's #SBATCH lines for this job
    only, and are kept with the job in run.json: after a TIMEOUT, a longer --time continues the run."""
    from ddpack.jobs.submit import record_job

    changes = {key: value for key, value in (changes or {}).items() if value is not None}
    record = read_record(run_dir)
    options = (*resubmit_options(changes, int(record.settings.get("spares") or 0)), *undepend(record))
    script, export = resubmit_ready(run_dir, record)
    if record.sweep:  # a sweep's point: its element of the sweep's array script, which picks its folder and command
        options = (f"--array={record.sweep['index']}", *options)
    job_id = slurm_cli.sbatch(script, run_dir, export=export, options=options)
    if record.sweep:
        job_id = f"{job_id}_{record.sweep['index']}"
    record_job(run_dir, job_id, "resubmit", changes)
    return job_id


def resubmit_ready(run_dir: Path, record: Any) -> tuple[Path, tuple[str, ...] | None]:
    """(the job script, the names sbatch --export hands the job) for a resubmit of the run, or one line (exit 2) why
    not: its image gone or changed, its script edited, a job of it still alive, a secret it was given not in this shell."""
    from ddpack.jobs.submit import LOGIN_ENV, image_key

    if record.settings.get("made_by") == "template":
        raise HostError(
            f"{run_dir} is a run started by hand with a template, whose settings ddpack did not keep; continue it as it was "
            f"started, with sbatch --export=ALL,DDPACK_RUN_DIR={run_dir} and the template",
            code=2,
        )
    sqsh = Path(record.sqsh["path"])
    if not sqsh.is_file():
        raise HostError(f"the image this run ran, {sqsh}, is gone; submit again (ddpack submit) to build and convert it", code=2)
    now = image_key(sqsh)
    if now != record.sqsh["key"]:
        raise HostError(
            f"the image at {sqsh} changed since this run was submitted (key {record.sqsh['key']}, now {now}): it is not the image "
            "this run ran; submit again (ddpack submit) for the new one",
            code=2,
        )
    script = run_dir / record.script
    if (problem := not_a_run_of_yours(script.parent, script)) is not None:
        raise HostError(f"{problem}; not resubmitting it", code=2)
    if hashlib.sha256(script.read_bytes()).hexdigest() != record.script_sha256:
        raise HostError(f"{script} was edited since it was submitted; submit again rather than resubmit a changed job", code=2)
    secrets = list(record.environment.get("secrets", []))
    missing = [name for name in secrets if not os.environ.get(name)]
    if missing:
        raise HostError(
            f"this run's secret {', '.join(missing)} is not set in this shell; export it and resubmit (its value goes to Slurm, never to a file)",
            code=2,
        )
    job = record.last_job
    if job is not None:
        queue = slurm_cli.queue_state(job.job_id)
        if queue.failed:
            raise HostError(f"cannot tell whether job {job.job_id} of this run is over: {queue.failed}; try again", code=2)
        if queue.listed and queue.state not in slurm_cli.FINAL:
            raise HostError(f"job {job.job_id} of this run is still {queue.state}; ddpack cancel it first, or wait for it", code=2)
    # A record from before the environment was recorded sent the whole shell; one that has it sends what it names.
    # A person chose to go on: the new job gets the failure restarts anew (the count caps one job's loop, not the run).
    failure_restarts = run_dir / module("ddpack_records").FAILURE_RESTARTS
    try:
        failure_restarts.unlink(missing_ok=True)
    except OSError as why:
        why_not = f"cannot reset the failure restarts' count {failure_restarts} ({why.strerror})"
        raise HostError(f"{why_not}; fix its folder's permissions and resubmit", code=1) from None
    return script, ((*LOGIN_ENV, *secrets) if record.environment else None)


def undepend(record: Any) -> tuple[str, ...]:
    """A resubmit continues now: a run submitted --after another drops the script's --dependency (whose job may be
    long gone, and Slurm would hold the job for it), as sbatch's empty --dependency= does."""
    return ("--dependency=",) if record.settings.get("dependency") else ()


def resubmit_options(changes: dict[str, Any], spares: int) -> tuple[str, ...]:
    """sbatch's options for a resubmit's changes, each checked: one line and exit 2 for a bad one."""
    from ddpack.jobs.submit import SLURM_TIME

    options = []
    if "time_limit" in changes:
        if not SLURM_TIME.fullmatch(str(changes["time_limit"])):
            raise HostError(f"--time {changes['time_limit']}: not a Slurm time (minutes, H:MM:SS, D-HH, D-HH:MM:SS)", code=2)
        options.append(f"--time={changes['time_limit']}")
    if "nodes" in changes:
        if int(changes["nodes"]) < 1:
            raise HostError(f"--nodes {changes['nodes']}: a job needs at least 1 node", code=2)
        options.append(f"--nodes={int(changes['nodes']) + spares}")  # the run's spares come on top, as at submit
    if "partition" in changes:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(changes["partition"])):
            raise HostError(f"--partition {changes['partition']!r}: not a partition's name", code=2)
        options.append(f"--partition={changes['partition']}")
    return tuple(options)


# --------------------------------------------------------------------------- rm


def remove(folder: Path) -> list[str]:
    """Delete a run's or a sweep's folder, refused in one line while a job of it may still live (a state Slurm did not
    settle counts as alive); the jobs it had, for the sentence."""
    import shutil

    from ddpack.jobs.status import run_status
    from ddpack.jobs.sweep import is_sweep, point_dirs

    runs = point_dirs(folder) if is_sweep(folder) else [folder]
    alive = []
    jobs = []
    for run_dir in runs:
        now = run_status(run_dir)
        jobs += [job.job_id for job in read_record(run_dir).jobs]
        if now.job_id and now.state not in ENDED:
            alive.append(f"{now.job_id} ({now.state})")
    if alive:
        raise HostError(f"{folder} has jobs that may still live: {', '.join(alive)}; ddpack cancel {folder} first, or wait for them", code=2)
    shutil.rmtree(folder)
    return jobs
