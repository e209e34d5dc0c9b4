"""Slurm's own command line, asked the way a run's lifecycle needs it: a failure is never read as an answer.

`squeue` that times out says nothing about a job; `squeue -j ID` for a job Slurm has purged says "Invalid job id"
and exits 1. The two are told apart here (QueueAnswer.failed vs .listed False), so a status command never
declares a run over, and never forgets it, because the controller was slow (torchx #1101 and SkyPilot #10457
are what goes wrong otherwise). `sacct` is optional: many clusters (and the test cluster) have no accounting.
"""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpack.errors import HostError
from ddpack.job_side import module

TIMEOUT_S = 30

# Slurm's job states as every ddpack verb reads them: the one table of them, the job's (enroot/ddpack_slurm.py, whose
# run folder lock asks which jobs are over), loaded from there.
JOB_STATES: dict[str, str] = module("ddpack_slurm").JOB_STATES
# ddpack's states in which a run's job has ended for good, and the exit status `logs -f` and `status --watch` end with:
# none of them 1 (ddpack itself failed: errors.HostError, a traceback) or 2 (bad input), so a script tells "the job
# failed" from "ddpack failed". The higher, the worse: a sweep exits with its worst point's (worst_exit).
ENDED: tuple[str, ...] = module("ddpack_slurm").ENDED
EXIT_FOR_STATE = {"COMPLETED": 0, "CANCELLED": 3, "TIMEOUT": 4, "PREEMPTED": 5, "FAILED": 6}  # one for each of ENDED
# The states a run's job waits or trains in, the liveliest first (a sweep is as lively as its liveliest point).
LIVE = ("RUNNING", "REQUEUED", "PENDING")
SETTLE_S = 10.0  # an ended state must hold this long before a verb believes it: a requeue passes through one
# Slurm's states in which a job has left its nodes for good (squeue -t all keeps them for MinJobAge seconds): the job
# helper's own set, derived once there from the same table.
OVER: frozenset[str] = frozenset(module("ddpack_slurm").OVER)


def exit_for(state: str) -> int:
    """The exit status of a job that ended in `state` (EXIT_FOR_STATE; a state it does not name counts as FAILED)."""
    return EXIT_FOR_STATE.get(state, EXIT_FOR_STATE["FAILED"])


def worst_exit(states: list[str]) -> int:
    """The exit status of jobs that ended in `states` (a sweep's points): the worst of theirs, 0 when all COMPLETED."""
    return max((exit_for(state) for state in states), default=0)


def time_limit_s(text: str | None) -> float | None:
    """Seconds of a Slurm time limit (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for none, UNLIMITED or another word."""
    if not text or not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(part) for part in rest.split(":")]
    if days:  # D-H[:M[:S]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return float(((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds)
    hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return float((hours * 60 + minutes) * 60 + seconds)


def ddpack_state(slurm_state: str) -> str:
    """Slurm's state (sacct may add " by UID") as ddpack names it."""
    word = slurm_state.split()[0] if slurm_state.split() else ""
    return JOB_STATES.get(word, word)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """A command's result: its output, or why it gave none (missing, timed out, failed)."""

    stdout: str = ""
    stderr: str = ""
    failed: str = ""  # empty when the command ran and exited 0


def ask(argv: list[str], timeout: float = TIMEOUT_S, cwd: Path | None = None) -> Answer:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except FileNotFoundError:
        return Answer(failed=f"{argv[0]} is not installed here (run ddpack on a machine with Slurm's commands: a login node)")
    except subprocess.TimeoutExpired:
        return Answer(failed=f"{argv[0]} did not answer in {timeout:.0f} s")
    if out.returncode != 0:
        last = [line for line in out.stderr.splitlines() if line.strip()]
        return Answer(
            stdout=out.stdout, stderr=out.stderr, failed=f"{argv[0]} failed (exit {out.returncode}: {last[-1] if last else 'no message'})"
        )
    return Answer(stdout=out.stdout, stderr=out.stderr)


@dataclass(frozen=True, kw_only=True)
class QueueAnswer:
    """What squeue says of one job: listed (with its state), not listed (Slurm forgot it), or failed (no answer)."""

    listed: bool = False
    state: str = ""  # PENDING, RUNNING, COMPLETING, REQUEUED, COMPLETED, CANCELLED, ...
    reason: str = ""
    nodes: str = ""
    failed: str = ""


def queue_state(job_id: str) -> QueueAnswer:
    answer = ask(["squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%T|%r|%N"])  # -r: a sweep's waiting point alone
    if answer.failed:
        if "Invalid job id" in answer.stderr:
            return QueueAnswer(listed=False)
        return QueueAnswer(failed=answer.failed)
    line = answer.stdout.strip().splitlines()[0] if answer.stdout.strip() else ""
    if not line:
        return QueueAnswer(listed=False)
    state, reason, nodes = [*line.split("|"), "", ""][:3]
    return QueueAnswer(listed=True, state=state.strip(), reason=reason.strip(), nodes=nodes.strip())


def queue_states(job_ids: list[str]) -> dict[str, str] | None:
    """{job id: state} for the jobs squeue still lists, in one call; None when squeue failed."""
    if not job_ids:
        return {}
    # %i with -r: a job's id, and each of a sweep's array elements as <array>_<index>, even those still waiting
    answer = ask(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T"])
    if answer.failed and "Invalid job id" not in answer.stderr:
        return None
    states = {}
    for line in answer.stdout.splitlines():
        job, _, state = line.partition("|")
        if job.strip():
            states[job.strip()] = state.strip()
    return states


def accounting_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, exit code)} from one sacct call for many jobs (ddpack ls); empty where there is no accounting."""
    if not job_ids:
        return {}
    answer = ask(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,ExitCode"])
    if answer.failed:
        return {}
    found = {}
    for line in answer.stdout.splitlines():
        job, _, rest = line.partition("|")
        state, _, code = rest.partition("|")
        if job.strip() and state.split():
            found[job.strip()] = (state.split()[0], code)
    return found


def accounting_state(job_id: str) -> tuple[str, str] | None:
    """(state, exit code) from sacct, where the cluster keeps accounting; None where it has none or fails."""
    answer = ask(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    if answer.failed or not answer.stdout.strip():
        return None
    state, _, code = answer.stdout.strip().splitlines()[-1].partition("|")
    return state.split()[0] if state.split() else "", code


SBATCH_TIMEOUT_S = 120


def queued_from(folder: Path) -> str:
    """After an sbatch that did not answer (a busy controller may have queued the job all the same): the job that
    squeue lists as working in `folder`, the run folder sbatch ran in, which tags the job; a line says it was found.
    None found, or no answer from squeue, is one line that says what to look for before submitting again (a retry
    could queue a second job)."""
    user = os.environ.get("USER") or getpass.getuser()
    look = f"squeue -u {user} -o '%A %Z'"
    found = ask(["squeue", "-h", "-u", user, "-o", "%A|%Z"])
    if found.failed:
        raise HostError(
            f"sbatch did not answer in {SBATCH_TIMEOUT_S} s and squeue could not say whether it queued the job ({found.failed}); "
            f"before submitting again, look for a job working in {folder}: {look}",
            code=1,
        )
    jobs = sorted(
        {job for job, _, where in (line.partition("|") for line in found.stdout.splitlines()) if where == str(folder) and job.isdigit()},
        key=int,
    )
    if not jobs:
        raise HostError(
            f"sbatch did not answer in {SBATCH_TIMEOUT_S} s and squeue lists no job working in {folder}: it was most likely not queued "
            f"(a controller this slow may still queue it: {look} lists it then); submit again",
            code=1,
        )
    print(
        f"sbatch did not answer in {SBATCH_TIMEOUT_S} s, but squeue lists job {jobs[-1]} working in {folder}: it was queued",
        file=sys.stderr,
        flush=True,
    )
    return jobs[-1]


def sbatch(script: Path, cwd: Path, *, export: tuple[str, ...] | None = None, options: tuple[str, ...] = ()) -> str:
    """Submit `script`; its job id. `export`: the only variables the job takes from this process's environment
    (sbatch --export=NAME,...: Slurm keeps their values with the job, and a requeue gets them again), None for all of
    them; `options` override the script's own #SBATCH lines. A refusal is one line naming sbatch's own reason; no
    answer is looked up in squeue by the folder it ran in (queued_from) before anything is said."""
    exporting = [f"--export={','.join(export) if export else 'NIL'}"] if export is not None else []
    answer = ask(["sbatch", "--parsable", *exporting, *options, str(script)], timeout=SBATCH_TIMEOUT_S, cwd=cwd)
    if answer.failed == f"sbatch did not answer in {SBATCH_TIMEOUT_S} s":
        return queued_from(cwd)
    if answer.failed:
        raise HostError(f"sbatch refused the job: {answer.failed}", code=2)
    job = answer.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise HostError(f"sbatch answered {answer.stdout.strip()!r}, not a job id", code=1)
    return job


def scancel(job_id: str) -> None:
    answer = ask(["scancel", job_id])
    if answer.failed:
        raise HostError(f"scancel {job_id}: {answer.failed}", code=1)


# sinfo's node states (%T, long form, without its flags) in which a node can run a job.
USABLE_NODE_STATES = ("idle", "mixed", "allocated", "completing", "planned")


def gres_gpus(gres: str) -> int:
    """The GPUs in sinfo's %G of a node ("gpu:8", "gpu:h100:8(S:0-1),efa:32", "(null)")."""
    total = 0
    for entry in gres.split(","):
        parts = entry.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_nodes(partition: str | None, gpus: int = 0) -> tuple[str, int, int] | str:
    """(the partition's name, its nodes that can run the job — with `gpus` GPUs or more each, when asked —, its
    others: down, drained, failing, not responding, too few GPUs) — the default partition when `partition` is None —,
    or why not."""
    answer = ask(["sinfo", "-h", "-o", "%P|%D|%T|%G", *(["-p", partition] if partition else [])])
    if answer.failed:
        return answer.failed
    usable, other, name = 0, 0, ""
    for line in answer.stdout.splitlines():
        part, count, state, gres = [*line.split("|"), "", "", ""][:4]
        if not (count.isascii() and count.isdigit()):
            return f"sinfo answered {line[:80]!r}, not PARTITION|NODES|STATE|GRES (a wrapper or a newer Slurm?); check `sinfo -h -o '%P|%D|%T|%G'`"
        default = part.endswith("*")
        part = part.rstrip("*")
        if not ((partition and part == partition) or (not partition and default)):
            continue
        name = part
        # A flag after the state: '*' not responding, '~' powered off (it powers up for a job), '#' powering up, ...
        base, flags = state.rstrip("*~#!%$@^-"), state[len(state.rstrip("*~#!%$@^-")) :]
        if base in USABLE_NODE_STATES and "*" not in flags and gres_gpus(gres) >= gpus:
            usable += int(count)
        else:
            other += int(count)
    if not name:
        if partition:
            return f"partition {partition} does not exist (sinfo lists none by that name)"
        return "this cluster has no default partition; give --partition"
    if usable + other == 0:
        return f"partition {name} does not exist or has no nodes"
    return name, usable, other


def node_size(partition: str | None, gpus: int = 0) -> tuple[int, int] | None:
    """(CPUs, GPUs) of the partition's smallest node that can run the job (with `gpus` GPUs or more each, when asked):
    what a point must ask less of to leave room for another; None where sinfo does not say (a point then takes whole
    nodes, as before)."""
    answer = ask(["sinfo", "-h", "-o", "%P|%D|%T|%G|%c", *(["-p", partition] if partition else [])])
    if answer.failed:
        return None
    sizes = []
    for line in answer.stdout.splitlines():
        part, _, state, gres, cpus = [*line.split("|"), "", "", "", ""][:5]
        mine = (partition and part.rstrip("*") == partition) or (not partition and part.endswith("*"))
        base = state.rstrip("*~#!%$@^-")
        if mine and cpus.strip().isdigit() and base in USABLE_NODE_STATES and gres_gpus(gres) >= gpus:
            sizes.append((int(cpus), gres_gpus(gres)))
    return min(sizes) if sizes else None


def pyxis_answer() -> str:
    """Why a pyxis job cannot run here ("" when srun has pyxis' --container-image): srun missing or failing is said
    as such, not as "no pyxis"."""
    answer = ask(["srun", "--help"])
    if answer.failed:
        return f"cannot ask srun whether pyxis is loaded: {answer.failed}"
    if "--container-image" not in answer.stdout:
        return "this cluster's srun has no --container-image (pyxis is not loaded), so the job would fail at its first line; ask for pyxis"
    return ""


def has_pyxis() -> bool:
    return not pyxis_answer()


def versions() -> dict[str, str]:
    """Slurm's, pyxis' and enroot's versions, as this host reports them ("" where a tool is absent)."""
    slurm = ask(["sinfo", "--version"]).stdout.strip()
    enroot = ask(["enroot", "version"]).stdout.strip()
    return {"slurm": slurm, "pyxis": pyxis_version(), "enroot": enroot}


def pyxis_version(plugstack: Path = Path("/etc/slurm/plugstack.conf.d")) -> str:
    """pyxis' version from its SPANK plugin (the string it logs), found through plugstack.conf.d; "" without it."""
    for conf in sorted(plugstack.glob("*.conf")) if plugstack.is_dir() else []:
        for line in conf.read_text(errors="replace").splitlines():
            words = line.split()
            plugin = next((w for w in words if w.endswith("spank_pyxis.so")), None)
            if plugin and Path(plugin).is_file():
                found = re.search(rb"pyxis: version (v?[0-9][0-9.]*)", Path(plugin).read_bytes())
                return found.group(1).decode() if found else "present"
    return "present" if has_pyxis() else ""
