"""Finding runs: the runs folder (DDPACK_RUNS, else the user's own on the shared filesystem), the run folders `ddpack
submit` made there (a sweep's points too), and the run a verb's RUN names: a run or sweep folder, one of its job ids,
or nothing (the newest run under the runs folder).
"""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.run_json import RunRecord, read_record
from ddpack.jobs.sweep_points import SWEEP_RECORD, is_sweep, list_sweeps, read_sweep
from train import run_folder

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
    `<array>_<index>` or its own number, SLURM_JOB_ID; the whole sweep its array's id or a resubmit's), or (None) the
    newest run or sweep there."""
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
            found = list_runs(where)
            # Slurm reuses job ids (a new cluster, a reset): the newest run or sweep that has it, whichever it is. A
            # sweep has its array's id and each of its mends' (resubmit --failed prints it).
            having = [*((record.created, folder) for folder, record in found if any(job.job_id == run for job in record.jobs)),
                      *((data.get("created", 0), folder) for folder, data in list_sweeps(where) if run in sweep_arrays(data))]  # fmt: skip
            # A point's own number (SLURM_JOB_ID, what Slurm's mails and sacct show of <array>_<index>), from its records.
            having = having or [(record.created, folder) for folder, record in found if record.sweep and ran_as(folder, run)]
            if having:
                return max(having, key=lambda item: item[0])[1]
        raise HostError(f"job {run} belongs to no run under {runs} or ./runs; name the run folder, or give --runs", code=2)
    raise HostError(f"{run} is neither a run folder nor a job id", code=2)


def sweep_arrays(data: dict[str, Any]) -> list[str]:
    """A sweep's job arrays (sweep.json): its own, then each resubmit's."""
    return [str(job) for job in [data.get("job_id"), *(mend.get("job_id") for mend in data.get("resubmits", []))] if job]


def ran_as(run_dir: Path, slurm_job: str) -> bool:
    """Whether a job of the run had Slurm's number `slurm_job` (its records' slurm_job: an array element's own id)."""
    from ddpack.jobs.decisions import read_decisions

    return any(str(entry.get("slurm_job")) == slurm_job for entry in read_decisions(run_dir))


def list_runs(runs: Path) -> list[tuple[Path, RunRecord]]:
    """The run folders `ddpack submit` made under `runs` (a sweep's points too, in its folder), oldest first."""

    found = []
    records = []
    if runs.is_dir():
        points = (path for path in runs.glob(f"*/*/{run_folder.RUN_RECORD}") if (path.parent.parent / SWEEP_RECORD).is_file())
        records = [*runs.glob(f"*/{run_folder.RUN_RECORD}"), *points]
    for path in records:
        try:
            found.append((path.parent, read_record(path.parent)))
        except Exception:  # another user's folder, or a damaged record: one run less in the list, never one acted on
            continue
    return sorted(found, key=lambda item: item[1].created)
