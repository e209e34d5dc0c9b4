"""Submitting and following Slurm jobs the way a user does, for the Slurm and pyxis tiers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddpack.jobs import slurm_cli
from ddpack.jobs.submit_checks import container_path
from testbed.env import ROOT, clean_env
from testbed.slurm_cluster import stage_dir
from testbed.users import User
from train import outcome

VENV = Path(sys.executable).parent.parent
PROGRESS_LINE = re.compile(r"\] epoch \d+/\d+ step \d+/\d+ \(global ")


def brief(log: Path | str) -> str:
    """A job log without its progress lines: the starts, snapshots, ends and the template's verdicts a failed
    check needs, short enough for a CI excerpt to show whole."""
    text = log if isinstance(log, str) else (log.read_text() if log.exists() else "")
    return "\n".join(line for line in text.splitlines() if not PROGRESS_LINE.search(line))


def cluster_now() -> str:
    """What Slurm says of every job and node at this moment, for a wait that timed out: a job pending, and on what
    (Resources, a node down, BeginTime), or a node that stopped answering, is then named in the failure itself."""
    said = []
    for command in (["squeue", "-h", "-o", "%i %T %r %N"], ["sinfo", "-h", "-N", "-o", "%N %P %T %E"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=20)
        said.append(f"$ {' '.join(command)}\n{(out.stdout + out.stderr).strip() or '(nothing)'}")
    return "\n".join(said)


def stuck(log: Path | str) -> str:
    """A wait's failure: the job's log (`brief`) and the cluster as Slurm sees it now (`cluster_now`)."""
    return f"{brief(log)}\n{cluster_now()}"


def env(**extra: str) -> dict[str, str]:
    """A job's environment: the bundle's venv, and the submitting user's staging folder on each node's own /tmp. No
    standby unless a test asks (DDPACK_STANDBYS: on these CPU nodes the default is one, a task more in every step of
    the bundled trainer): a job submitted by hand keeps the shape its test was written for. `ddpack submit` takes no
    DDPACK_* of its shell, so a run it submits has the default (tests/test_lifecycle_cluster.py)."""
    return clean_env(DDPACK_VENV=str(VENV), DDPACK_STAGE_DIR=str(stage_dir(os.getuid())), **{"DDPACK_STANDBYS": "0", **extra})


def as_user(user: User | None, job_env: dict[str, str]) -> dict[str, object]:
    """subprocess.run's keywords that submit as `user` (None: this process's user): that user's HOME and staging
    folder, and a PATH without root's own tools (a python3 under /root is not theirs to run)."""
    if user is None:
        return {"env": job_env}
    runs = user.runs()
    runs["env"] = {
        **job_env,
        **runs["env"],  # type: ignore[dict-item]
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "DDPACK_STAGE_DIR": str(stage_dir(user.uid)),
    }
    return runs


def all_agree(text: str, world: int) -> bool:
    """`world` ranks in a job log (or the part after a requeue) finished, and on the same parameters: their
    end records' checksums."""
    sums = outcome.checksums(text)
    return len(sums) == world and len(set(sums)) == 1


def sbatch(template: str, cwd: Path, sbatch_args: tuple[str, ...] = (), **settings: str) -> tuple[int, str]:
    """Submit as a user does (logs folder first), wait for the end, return (the job's exit code, job id)."""
    (cwd / "logs").mkdir(exist_ok=True)
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())])
    out = subprocess.run(
        ["sbatch", "--parsable", f"--export={exports}", *sbatch_args, str(ROOT / "enroot" / template)],
        env=env(OMP_NUM_THREADS="1"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    return wait_for_exit(job), job


def wait_for_exit(job: str, timeout: float = 900) -> int:
    """The batch script's exit code once the job has left its nodes, asked every half second. (`sbatch --wait` asks
    after 2, 10, 42, 74, ... seconds: a job of 12 s cost the test 42.)"""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job)
        if fields.get("JobState") in FINAL_STATES:
            return int(fields.get("ExitCode", "1:0").split(":")[0])
        assert time.monotonic() < deadline, f"job {job} did not end within {timeout:.0f} s: {fields.get('JobState')}\n{cluster_now()}"
        time.sleep(0.5)


FINAL_STATES = slurm_cli.OVER


def job_fields(job: str) -> dict[str, str]:
    """scontrol's fields of a job (kept for MinJobAge seconds after it ends); {} once Slurm has forgotten it."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def job_state(job: str) -> tuple[str, str, int]:
    """(JobState, Reason, Restarts) from scontrol."""
    fields = job_fields(job)
    return fields.get("JobState", ""), fields.get("Reason", ""), int(fields.get("Restarts", "0"))


def submit(
    tmp_path: Path,
    name: str,
    sbatch_args: tuple[str, ...] = (),
    template: str = "baremetal.sbatch",
    user: User | None = None,
    **settings: str,
) -> tuple[str, Path, Path]:
    """Submit a template from `tmp_path` (as `user`, else as this process's user) and return at once: (job, its
    metrics file, its log)."""
    (tmp_path / "logs").mkdir(exist_ok=True)
    if user is not None:
        os.chown(tmp_path / "logs", user.uid, user.gid)
    trainer = (
        []
        if {"DDPACK_COMMAND", "DDPACK_TRAIN_ARGS"} & settings.keys()
        else ["DDPACK_TRAIN_ARGS=--dataset-size 16384 --epochs 2 --log-every 1"]
    )
    exports = ",".join(["ALL", *trainer, *(f"{k}={v}" for k, v in settings.items())])
    job = (
        subprocess.run(
            ["sbatch", "--parsable", f"--job-name={name}", f"--export={exports}", *sbatch_args, str(ROOT / "enroot" / template)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            **as_user(user, env(OMP_NUM_THREADS="1")),  # type: ignore[arg-type]
        )
        .stdout.strip()
        .split(";")[0]
    )
    return job, tmp_path / "runs" / f"{name}-{job}" / "metrics.jsonl", tmp_path / "logs" / f"{name}-{job}.out"


# Found anywhere in a line: srun labels a program's lines with their rank ("R: ", the per-task template), and another
# process's output may share a line with them.
HELD_LINE = re.compile(r"held_task: rank (\d+) held at batch \d+ of start (\S+?) until ")
SIGNALLED_LINE = re.compile(r"held_task: rank (\d+) got (SIG[A-Z0-9]+) while held in start (\d+\.\d+)")
# The held task's trainer flags: with its batches fetched in the training process, batch N is step N of a start.
HELD_TRAIN_ARGS = "--task held_task:regression_held --num-workers 0"


@dataclass(frozen=True)
class Gate:
    """A job's training held mid-run until the test opens it (testbed/held_task.py): a test that acts on a running
    job decides from what it controls, not from how fast the host trains.

    `settings` are the job's (HOLD_AT, HOLD_UNTIL), `train_args` the bundled trainer's flags (DDPACK_TRAIN_ARGS) with
    the held task first (a program of the user's holds its steps itself: tests/frameworks/faults.py); `folder` is the
    gate's folder on this host, the job's submission folder, which the container may see at another path."""

    folder: Path
    settings: dict[str, str]
    train_args: str = HELD_TRAIN_ARGS

    def held(self, log: Path, world: int, seen: tuple[str, ...] = (), timeout: float = 300) -> str:
        """Wait until `world` ranks of one start (not one of the starts `seen`) are held; that start's key."""
        deadline = time.monotonic() + timeout
        while True:
            ranks: dict[str, set[int]] = {}
            for rank, key in HELD_LINE.findall(log.read_text() if log.exists() else ""):
                ranks.setdefault(key, set()).add(int(rank))
            full = [key for key, held in ranks.items() if len(held) >= world and key not in seen]
            if full:
                return full[0]
            assert time.monotonic() < deadline, f"{world} ranks were not held within {timeout:.0f} s:\n{stuck(log)}"
            time.sleep(0.2)

    def signalled(self, log: Path, key: str, world: int, name: str = "SIGUSR1", timeout: float = 120) -> None:
        """Wait until `name` has reached `world` held ranks of start `key`: opened then, the gate lets them stop at the
        next step, whenever Slurm delivered the signal."""
        deadline = time.monotonic() + timeout
        while len({r for r, sig, k in SIGNALLED_LINE.findall(log.read_text()) if (sig, k) == (name, key)}) < world:
            assert time.monotonic() < deadline, f"{name} did not reach {world} held ranks of start {key}:\n{stuck(log)}"
            time.sleep(0.2)

    def open(self, key: str | None = None) -> None:
        """Let start `key` go on; with no key, every start now held and every one to come."""
        gate = self.folder / (f"gate-{key}" if key else "gate")
        gate.touch()
        gate.chmod(0o644)


def hold_training(folder: Path, at: int = 20, mounts: str | None = None, train_args: str = "") -> Gate:
    """Copy the held task into the job's submission folder `folder` (where the trainer imports `--task` modules
    from) and return its gate; `mounts`: the job's DDPACK_MOUNTS, when it runs in a container."""
    inside = container_path(folder, mounts) if mounts else None
    assert inside or not mounts, f"{folder} is under none of the mounts {mounts}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("held_task.py"), folder / "held_task.py")
    (folder / "held_task.py").chmod(0o644)
    # The held task's flags last: the test's own cannot undo them.
    return Gate(folder, {"HOLD_AT": str(at), "HOLD_UNTIL": f"{inside or folder}/gate"}, f"{train_args} {HELD_TRAIN_ARGS}".strip())


def submit_and_preempt(
    tmp_path: Path, name: str, sbatch_args: tuple[str, ...] = (), template: str = "baremetal.sbatch", **settings: str
) -> tuple[str, Path]:
    """Submit a template and signal USR1 mid-run, as `--signal=USR1@90` would; returns (job, log). The job is held
    at step 20 of its first start until every rank has the signal, so it cannot end before it."""
    gate = hold_training(tmp_path, 20, settings.get("DDPACK_MOUNTS"), "--dataset-size 4096 --epochs 2 --log-every 1")  # 58 steps
    job, _, log = submit(tmp_path, name, sbatch_args, template, **gate.settings, DDPACK_TRAIN_ARGS=gate.train_args, **settings)
    world = int(settings.get("DDPACK_NPROC", "1")) * world_of(job)
    key = gate.held(log, world)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    gate.signalled(log, key, world)
    gate.open()
    return job, log


def world_of(job: str) -> int:
    """The tasks of a job, from scontrol (NumTasks)."""
    return int(job_fields(job).get("NumTasks", "1"))


def preempt_and_resume(
    tmp_path: Path, name: str, sbatch_args: tuple[str, ...] = (), template: str = "baremetal.sbatch", **settings: str
) -> str:
    """Submit, preempt, let the job requeue and finish; returns the whole appended log."""
    job, log = submit_and_preempt(tmp_path, name, sbatch_args, template, **settings)
    text = wait_for_restarts(job, 1, log)
    assert "(restart 1)" in text, text
    return text


def progress_count(metrics: Path) -> int:
    return metrics.read_text().count('"progress"') if metrics.exists() else 0


def wait_for_progress(metrics: Path, count: int, log: Path, what: str = "", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while progress_count(metrics) < count:
        assert time.monotonic() < deadline, f"{what or f'training did not reach {count} progress records'}:\n{stuck(log)}"
        time.sleep(0.2)


def signal_tasks(job: str, node: str, sig: signal.Signals = signal.SIGKILL, rank: int | None = None) -> list[int]:
    """Send `sig` to every process of `job`'s newest step on `node` (its training step: the templates' set-up
    steps have ended by then; the test nodes run on this host, and a task's environment names its node), or to
    rank `rank`'s alone. SIGKILL is a kernel panic or the OOM killer (no signal to catch); SIGSTOP a frozen
    process."""
    steps: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() not in environ or f"SLURMD_NODENAME={node}".encode() not in environ:
            continue
        step = next((int(v[len(b"SLURM_STEP_ID=") :]) for v in environ if v.startswith(b"SLURM_STEP_ID=")), None)
        if step is None or step >= 0xFFFFFFF0:  # the batch script, the extern step
            continue
        if rank is None or f"SLURM_PROCID={rank}".encode() in environ:
            steps.setdefault(step, []).append(int(entry.name))
    pids = steps[max(steps)] if steps else []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


# The job program's own lines (enroot/ddpack_job.py, enroot/ddpack_training.py) that open a start and that announce a requeue.
START_OR_REQUEUE = re.compile(r"^ddpack: (?:job \d+ \(restart \d+\) on |.*\brequeueing job \d+)", re.M)


def requeue_announced(log: Path) -> bool:
    """Whether the job's last word in its log is a requeue (said before it asks Slurm for one), not a start."""
    said = START_OR_REQUEUE.findall(log.read_text(errors="replace") if log.exists() else "")
    return bool(said) and "requeueing job" in said[-1]


def wait_for_end(job: str, log: Path, timeout: float = 480) -> tuple[str, int]:
    """Wait until the job has ended for good (not a requeue passing through an ended state); (its final state,
    its requeue count). The job decides its requeues and says so in its log before it asks Slurm: an ended state
    after a start (or a job that never started) is the end, at once; one after an announced requeue must hold 10 s,
    as the verbs' settle does (ddpack/jobs/slurm_cli.py), since the requeue may be passing through it."""
    deadline, ended = time.monotonic() + timeout, None
    while True:
        state, _, count = job_state(job)
        ended = (ended or time.monotonic()) if state in FINAL_STATES else None
        if ended is not None and (not requeue_announced(log) or time.monotonic() - ended > 10):
            return state, count
        assert time.monotonic() < deadline, f"job {job} did not end: {state}\n{stuck(log)}"
        time.sleep(0.5)


def wait_for_restarts(job: str, restarts: int, log: Path, timeout: float = 480) -> str:
    """Wait until the job's run after its `restarts`-th requeue has ended; returns the whole appended log.
    Slurm starts a requeued job once the old credential expires (cred_expire in the test cluster)."""
    deadline, seen, pending_again, ended_early = time.monotonic() + timeout, [], False, None
    while True:
        state, reason, count = job_state(job)
        if not seen or seen[-1] != (state, reason, count):
            seen.append((state, reason, count))
        pending_again = pending_again or (count >= restarts and state == "PENDING")
        if pending_again and state in FINAL_STATES:  # that run ending, not the one before its requeue
            break
        # A requeue passes through an ended state for a moment; one that lasts a minute (a loaded slurmctld
        # still requeues within seconds) is the end.
        ended_early = (ended_early or time.monotonic()) if state in FINAL_STATES else None
        if ended_early is not None and time.monotonic() - ended_early > 60:
            raise AssertionError(f"job {job} ended ({state}) after {count} restarts, not {restarts}: {seen}\n{brief(log)}")
        assert time.monotonic() < deadline, f"job {job} did not finish: {seen}\n{stuck(log)}"
        time.sleep(1)
    return log.read_text()
