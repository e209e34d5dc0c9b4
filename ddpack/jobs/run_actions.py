"""Acting on a run: `ddpack cancel`, `resubmit` and `rm`, over the run folder `ddpack submit` made (a resubmit is a
new job that continues the folder, with the same job script and image, refused in one line when either changed).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.job_side import module
from ddpack.jobs import slurm_cli
from ddpack.jobs.run_json import append_event, not_a_run_of_yours, read_record
from ddpack.jobs.slurm_cli import ENDED

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
    if not queue.listed or queue.state in slurm_cli.OVER:
        raise HostError(
            f"job {job.job_id}, this run's newest, has ended ({queue.state or 'Slurm no longer lists it'}); nothing to cancel", code=2
        )
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
    from ddpack.jobs.submit import image_key
    from ddpack.jobs.submit_checks import LOGIN_ENV

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
        if queue.listed and queue.state not in slurm_cli.OVER:
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
    from ddpack.jobs.submit_checks import SLURM_TIME

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
    settle counts as alive) and for a sweep's point alone; the jobs it had, for the sentence."""
    import shutil

    from ddpack.jobs.status import run_status
    from ddpack.jobs.sweep_points import is_sweep, point_dirs

    point = None if is_sweep(folder) else read_record(folder).sweep
    if point and is_sweep(Path(point["dir"])):  # every sweep verb goes through every point: none may go missing
        raise HostError(f"{folder} is point {point['index']} of the sweep {point['dir']}, whose verbs need every point; "
                        f"ddpack rm {point['dir']} removes the whole sweep", code=2)  # fmt: skip
    runs = point_dirs(folder) if is_sweep(folder) else [folder]
    alive = []
    jobs = []
    for run_dir in runs:
        now = run_status(run_dir)
        jobs += [job.job_id for job in read_record(run_dir).jobs]
        if now.job_id and now.state not in ENDED:
            alive.append(f"{now.job_id} ({now.state})")
    if alive:
        raise HostError(
            f"{folder} has jobs that may still live: {', '.join(alive)}; ddpack cancel {folder} first, or wait for them", code=2
        )
    shutil.rmtree(folder)
    return jobs
