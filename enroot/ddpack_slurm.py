"""ddpack_slurm.py — what the job asks Slurm, asked once a decision, and the one builder of a step on each node.

Standard library only, on the batch host (enroot/ddpack_job.py loads it). A decision reads the job's facts once
(`JobFacts`: one `scontrol show job` for its nodes, GRES, log and script; one `scontrol show hostnames` for their names;
one `sinfo` for their health) and passes them on, so its parts cannot disagree with each other between two reads, and
a restart decision costs one read of each, not four.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable

from ddpack_node import SQUEUE_TIMEOUT_S, one_line, warn

# Slurm's job states (squeue's and sacct's, without sacct's "by UID" suffix) as ddpack names them: the one table of
# them, the host's too (ddpack/jobs/slurm_cli.py loads it). PREEMPTED is a job Slurm ended to make room (PreemptMode=CANCEL,
# after its grace time): it has left its nodes for good, like a cancel, and `ddpack resubmit` continues its run; a
# preemption that requeues shows as REQUEUED. States not listed (newer Slurms add some) are shown as Slurm names them
# and read as live.
JOB_STATES = {
    "PENDING": "PENDING",
    "CONFIGURING": "RUNNING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "RESIZING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "SUSPENDED": "RUNNING",
    "STOPPED": "RUNNING",
    "REQUEUED": "REQUEUED",
    "REQUEUE_FED": "REQUEUED",
    "REQUEUE_HOLD": "REQUEUED",
    "SPECIAL_EXIT": "REQUEUED",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "BOOT_FAIL": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "DEADLINE": "TIMEOUT",
    "PREEMPTED": "PREEMPTED",
}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED")  # ddpack's states of a job that ended for good
# States in which squeue still lists a job (for MinJobAge) that has left its nodes for good.
OVER = {state for state, ours in JOB_STATES.items() if ours in ENDED}


def job_state(job: str) -> str | None:
    """The state squeue gives job `job` (any user's) while it lives, "" when Slurm no longer lists it or lists it
    as over, None when squeue failed."""
    out = command(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    state = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return "" if state in OVER else state


def command(argv: list[str], *, timeout: float | None = None, **options: object) -> subprocess.CompletedProcess:
    """`argv` run as subprocess.run runs it; a command that is missing, cannot start (E2BIG) or outlives `timeout`
    is a failed one (status 127, or 124 for the timeout, with empty output), as the shell would have it: the job's
    decisions go on with what they know, they never end in a traceback."""
    try:
        return subprocess.run(argv, timeout=timeout, **options)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "" if options.get("text") else b"", "")
    except OSError as why:
        warn(f"{argv[0]}: {one_line(why)}")
        return subprocess.CompletedProcess(argv, 127, "" if options.get("text") else b"", "")


def hostnames(hostlist: str) -> list[str] | None:
    """Slurm's hostlist (ddnode[1-3],gpu1) as names, as `scontrol show hostnames` expands it; None when scontrol did
    not answer (three tries a second apart): unknown, never "no nodes"."""
    if not hostlist:
        return []
    for attempt in range(3):
        out = command(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
        if out.returncode == 0:
            return out.stdout.split()
        if attempt < 2:
            time.sleep(1)
    return None


def natural(name: str) -> list[object]:
    """`sort -V`'s order for node names: node2 before node10."""
    return [int(part) if part.isascii() and part.isdigit() else part for part in re.split(r"([0-9]+)", name)]


class JobFacts:
    """What Slurm says of job `job` now, each asked at most once and only when a decision needs it: `scontrol show job`
    (its nodes, the GPUs it asked for, its log and script), the nodes' names, their health in sinfo. Read again (a new
    JobFacts) for each decision: a --no-kill job that lost a node no longer lists it."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._sinfo: tuple[frozenset[str], set[str]] | None = None  # (the names asked about, the unhealthy among them)

    @functools.cached_property
    def shown(self) -> str:
        """`scontrol show job JOB`'s text; empty when it fails."""
        return command(["scontrol", "show", "job", self.job], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S).stdout

    def field(self, name: str) -> str:
        """A field of `scontrol show job`, "" when it has none. A field alone on its line (Command=, StdOut=) is read
        whole, spaces and all; one among others (TresPerNode=, NodeList= in some versions) is read as one word."""
        for line in self.shown.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key == name:
                return value
            for word in line.split():
                key, sep, value = word.partition("=")
                if sep and key == name:
                    return value
        return ""

    @property
    def nodelist(self) -> str:
        """The job's nodes as Slurm lists them now (a hostlist): a --no-kill job that lost a node no longer holds it,
        while SLURM_JOB_NODELIST still names it."""
        listed = self.field("NodeList")
        return listed if listed not in ("", "(null)") else os.environ.get("SLURM_JOB_NODELIST", "")

    @functools.cached_property
    def nodes(self) -> list[str] | None:
        """The names of `nodelist`; None when scontrol did not expand it (unknown, never "no nodes")."""
        return hostnames(self.nodelist)

    @property
    def gpus_per_node(self) -> int:
        """The GPUs a node this job asked Slurm for (its TresPerNode: --gpus-per-node, --gres=gpu:N; several types add
        up), 0 for none. Asked of Slurm, not read from SLURM_GPUS_* variables, which a job submitted from inside a GPU
        allocation inherits."""
        total = 0
        for entry in self.field("TresPerNode").split(","):
            if re.fullmatch(r"gres[:/]gpu(:.*)?", entry):
                count = entry.rsplit(":", 1)[-1]
                total += int(count) if re.fullmatch(r"[0-9]+", count) else 1
        return total

    def unhealthy(self, names: Iterable[str]) -> set[str]:
        """Those of `names` that sinfo says are down, drained, failing or not responding: one sinfo for the job's nodes
        and these, asked again only for a name it was not asked about."""
        want = set(names)
        if self._sinfo is None or not want <= self._sinfo[0]:
            ask = frozenset(want | set(self.nodes or []) | (self._sinfo[0] if self._sinfo else set()))
            self._sinfo = (ask, set(unhealthy_nodes(",".join(sorted(ask, key=natural)))) if ask else set())
        return self._sinfo[1] & want


def unhealthy_nodes(hostlist: str) -> list[str]:
    """The nodes of `hostlist` that sinfo says are down, drained, failing or not responding (a trailing *)."""
    out = command(["sinfo", "-h", "-N", "-n", hostlist, "-o", "%N %t"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    found = []
    for line in out.stdout.splitlines():
        node, _, state = line.partition(" ")
        if state.startswith(("down", "drain", "drng", "fail")) or state.endswith("*"):
            found.append(node)
    return found


def on_each_node(nodelist: str, count: int, argv: list[str], *options: str) -> list[str]:
    """The one shape of a step the job runs on nodes of its own, one task on each: `srun OPTIONS... --nodes=COUNT
    --ntasks=COUNT --ntasks-per-node=1 --nodelist=NODELIST ARGV...`."""
    return ["srun", *options, f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={nodelist}", *argv]


def node_program(verb: str, *args: str) -> list[str]:
    """enroot/ddpack_node.py's VERB as a node runs it: its text, and only its, sent with the step (`python3 -I -S -c`,
    the batch host's python3: the nodes need no checkout)."""
    return [sys.executable, "-I", "-S", "-c", node_text(), verb, *args]


@functools.cache
def node_text() -> str:
    import ddpack_node

    return open(ddpack_node.__file__).read()
