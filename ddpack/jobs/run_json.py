"""A run's record, `run.json` in its folder: what ran (image, code, command, settings, the job script, the cluster's
versions) and every job that ran it. Written before the first job is submitted, so the folder alone says what ran
and can run it again (`ddpack resubmit`); each submission appends its job.

One definition: `ddpack submit` writes it, `status`, `logs`, `cancel`, `ls` and `resubmit` read it. Writes go
through a temporary name beside the file and a rename under the record's one lock (the job's, which also records a
run started by hand with a template), so a reader never sees half a record and two writers never lose each other's job.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.job_side import module
from ddpack.private_files import not_yours_alone, write_atomically
from train import run_folder
from train.run_folder import RUN_RECORD

FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Job:
    job_id: str
    attempt: int  # 1 for the submission, then one more per resubmit
    submitted: float
    how: str  # "submit" or "resubmit"
    changes: dict[str, Any] = field(default_factory=dict)  # a resubmit's new --time, --nodes or --partition
    log: str | None = None  # where Slurm writes its output, when not the run folder's logs/slurm-<job>.out (a template job)

    def log_path(self, run_dir: Path) -> Path:
        """The job's log: Slurm's --output, which `ddpack submit` points into the run folder, or the one a job started
        by hand with a template named in its record."""
        return Path(self.log) if self.log else run_dir / run_folder.LOGS / run_folder.job_log(self.job_id)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    name: str
    run_dir: str
    created: float
    user: str
    host: str
    image: dict[str, Any]  # ref, id, bundle, ecr_digest
    sqsh: dict[str, Any]  # path, key, size, mtime_ns
    code: dict[str, Any]  # app_dir, digest, git_commit, git_dirty, diff_sha256, diff_file
    command: list[str]
    settings: dict[str, Any]
    script: str  # the job script, relative to the run folder
    script_sha256: str
    versions: dict[str, str]
    jobs: list[Job] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # cancels, with time and job
    environment: dict[str, Any] = field(default_factory=dict)  # script, login_shell (values), secrets (names only)
    run_file: dict[str, Any] | None = None  # the run file's path, digest and text (ddpack submit --file)
    sweep: dict[str, Any] | None = None  # a sweep's point: the sweep's folder, this point's index and values
    tags: dict[str, str] = field(default_factory=dict)  # submit --tag KEY=VALUE, then ddpack tag
    note: str | None = None  # submit --note, then ddpack tag --note
    format: int = FORMAT

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: Path) -> RunRecord:
        if data.get("format") != FORMAT:
            raise HostError(f"{where} is a run record of format {data.get('format')!r}; this ddpack reads format {FORMAT}", code=2)
        try:
            return cls(**{**data, "jobs": [Job(**job) for job in data.get("jobs", [])]})
        except TypeError as exc:
            raise HostError(f"{where} is not a ddpack run record ({exc}); it may have been edited by hand", code=2) from None

    @property
    def last_job(self) -> Job | None:
        return self.jobs[-1] if self.jobs else None


def record_path(run_dir: Path) -> Path:
    return run_dir / RUN_RECORD


def not_a_run_of_yours(*items: Path) -> str | None:
    """Why the run folder or a file of it (given, when they exist) is not this user's alone, or None: a run folder sits
    in a shared runs folder, where another user can make folders and plant records."""
    for item in items:
        if os.path.lexists(item) and (problem := not_yours_alone(item, "folder" if item.is_dir() else "file")) is not None:
            return f"{item} {problem}"
    return None


def read_record(run_dir: Path) -> RunRecord:
    """The run's record, read only from a run folder and a run.json of this user's that nobody else can write: a
    record another user planted could name this user's jobs (cancel) or a script of theirs (resubmit)."""
    path = record_path(run_dir)
    if (problem := not_a_run_of_yours(run_dir, path)) is not None:
        raise HostError(f"{problem}; it is not a run of yours", code=2)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HostError(
            f"{run_dir} holds no {RUN_RECORD}: it is not a run `ddpack submit` made (give a run folder, or a job id)", code=2
        ) from None
    except (OSError, ValueError) as exc:
        raise HostError(f"cannot read {path}: {exc}", code=2) from None
    if not isinstance(data, dict):
        raise HostError(f"{path} is not a ddpack run record", code=2)
    return RunRecord.from_dict(data, path)


def write_json_atomic(path: Path, data: dict[str, Any], *, cache: bool = False) -> None:
    """`data` as JSON at `path`: a private temporary file beside it, then a rename (never half a file, never
    through a planted name). Readable as the run folder is (the umask decides who may read the folder). A `cache`
    (made again when a crash loses it) is one line, by json's encoder in C (an indent takes its Python one: 10 ms a
    digest of the trainer's records), renamed without waiting for the disk (an fsync is ~20 ms of a shared one)."""
    text = json.dumps(data) if cache else json.dumps(data, indent=2, sort_keys=True)
    write_atomically(path, text + "\n", mode=0o644 & ~current_umask(), durable=not cache)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_record(record: RunRecord) -> None:
    run_dir = Path(record.run_dir)
    with _locked(run_dir):
        write_json_atomic(record_path(run_dir), asdict(record))


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """The record's one lock, the job's own (enroot/ddpack_records.py `guard` on .run.json.lock, which the job takes to
    record a run started by hand with a template): an flock, or an O_EXCL guard file where the filesystem has none."""
    with module("ddpack_records").guard(run_dir / f".{RUN_RECORD}.lock"):
        yield


def append_job(run_dir: Path, job_id: str, how: str, changes: dict[str, Any] | None = None) -> Job:
    """Add a submitted job to the record, re-read under the lock so a concurrent append is kept."""
    with _locked(run_dir):
        record = read_record(run_dir)
        job = Job(job_id=job_id, attempt=len(record.jobs) + 1, submitted=time.time(), how=how, changes=changes or {})
        data = asdict(record)
        data["jobs"].append(asdict(job))
        write_json_atomic(record_path(run_dir), data)
    return job


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    with _locked(run_dir):
        data = asdict(read_record(run_dir))
        data["events"].append({"time": time.time(), **event})
        write_json_atomic(record_path(run_dir), data)


def update_tags(run_dir: Path, tags: dict[str, str], removed: tuple[str, ...] = (), note: str | None = None) -> dict[str, str]:
    """Set `tags`, drop `removed` and (when given) replace the note, re-read under the lock; the run's tags now."""
    with _locked(run_dir):
        data = asdict(read_record(run_dir))
        data["tags"] = {key: value for key, value in {**data.get("tags", {}), **tags}.items() if key not in removed}
        if note is not None:
            data["note"] = note or None
        write_json_atomic(record_path(run_dir), data)
    return data["tags"]
