"""ddpack_step.py — one training step's srun, run by the job program (ddpack_training.Training) with its output passed
through line by line and read as it comes: srun's lines of tasks that ended and nodes that failed, the ranks' end
records, the standbys' leaving records and the store task's lines; how the step ended (StepEnd).

Standard library only, on the batch host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import threading
from collections.abc import Callable

from ddpack_node import one_line, warn
from ddpack_records import say
from ddpack_step_records import RECOVERY_FALLBACK

# srun's line for tasks that ended badly, "srun: error: NODE: task 3: Exited with exit code 1" (or "tasks 0-1: Killed").
TASK_ENDED = re.compile(rb"srun: error: ([A-Za-z0-9._-]+): tasks? ([0-9,-]+): (.*)")
NOT_A_CRASH = (b"Terminated", b"Exited with exit code 0")  # srun's own TERM for a stop; a task that ended well
NODE_FAILED = re.compile(rb"srun: error: Node failure on ([A-Za-z0-9._-]+)")  # Slurm dropped the node from the job
RECOVERED_MARK = b"] recovery: trained global step "  # rank 0's line once a recovery's first step is done (train/trainer.py)
STORE_SERVING_MARK = b": serving the job's store at "  # the store task's line once it serves (train/recovery.py serve_store)
GROUP_FORMED_MARK = b"] start: rank "  # each rank's first line, printed once the ranks formed their group (train/__main__.py)
# srun's and slurmstepd's lines when the step is being ended (scancel, a preemption, the time limit, end_step's TERM):
# the tasks' ends that follow are the stop's, not failures to act on.
STEP_STOPPING = re.compile(rb"\*\*\* STEP \S+ ON \S+ CANCELLED|srun: forcing job termination|srun: Job step aborted")
# How long srun's line that a task ended waits for the line that would make that end harmless (the store task's that it
# served, a rank's that the group formed, srun's that the step is being ended): they come on two pipes (srun's stderr,
# the tasks' stdout), each read by its own thread, in either order.
SERVING_LINE_WAIT_S = 2.0
BAD_INPUT = "Exited with exit code 2"  # a task that refused its input (the trainer's one line): no restart retries it
# How long srun's line that ranks ended before the group formed waits for a rank's start line: longer than the store's
# wait, because the start line's reader first copies every line before it into the job's log (a slow shared disk,
# torch's start-up warnings from every rank), and a death just after the group formed is recovery's to mend.
GROUP_LINE_WAIT_S = 15.0
# A task's end by a stop's signal (the time limit's warning, SIGUSR1, before the trainer's watcher takes it; a TERM the
# trainer passed on): the stop's to decide (requeue), never a failure of the start.
STOP_STATUSES = ("User defined signal 1", "Exited with exit code 138", "Exited with exit code 143")
END_MARK = b"ddpack-end "  # train/outcome.py's end record: {"rank", "host", "outcome", "reason", ...}
STANDBY_END_MARK = b"ddpack-standby-end "  # train/outcome.py's StandbyEnd: {"member", "host", "why", "detail", ...}
# train/outcome.py's CAUSES of a failed rank that crashed nothing (a peer died; recovery fell back after one did). An
# image older than the field says the first in its reason's words, LEFT_BY_A_PEER, and a fallback in FALLBACK's.
NOT_CRASHED = ("peer", "recovery-fallback", "counted-dead")
LEFT_BY_A_PEER = "a collective failed"


def task_ids(tasks: bytes) -> list[int]:
    """The tasks srun's list names ("3", "0-1,4"); none where it is no such list (a task's own line that looks like
    srun's, "task 3,: x": the tasks share srun's pipes, and a reader that raised would leave them full, the step stuck)."""
    ids: list[int] = []
    try:
        for part in tasks.split(b","):
            low, _, high = part.partition(b"-")
            ids.extend(range(int(low), int(high or low) + 1))
    except ValueError:
        return []
    return ids


def crashed_node(ended: list[tuple[str, int]], left: dict[str, int]) -> str:
    """The node whose task crashed, from srun's lines (`ended`: node and task count, in srun's order) and the ranks'
    end records (`left`: per host, the ranks that say a peer left them, which crashed nothing): the first node srun
    names with more tasks that ended badly than ranks a peer left; else the first srun names ("" for none). A rank
    that crashes is often not the first srun hears of: its peers may exit before its own teardown ends."""
    counts: dict[str, int] = {}
    for node, count in ended:  # srun may name one node's tasks on several lines (one killed, one exited)
        counts[node] = counts.get(node, 0) + count
    for node, count in counts.items():  # in the order srun first named them
        if count > left.get(node, 0):
            return node
    return ended[0][0] if ended else ""


@dataclasses.dataclass
class StepEnd:
    """What one training step said of its end: its status (as `command` gives it), the node whose task crashed ("" for
    none), and each rank's last end record's exit status (train/outcome.py's, printed by every rank of the bundled
    trainer) with the world size the records name."""

    code: int
    crashed: str = ""
    exits: dict[int, int] = dataclasses.field(default_factory=dict)
    world: int = 0
    standbys_left: list[dict] = dataclasses.field(default_factory=list)  # the standbys' leaving records (StandbyEnd)

    def status(self, standbys: int) -> int:
        """The step's exit status for the restart decision. srun's own is the worst of its tasks', and with standbys a
        task that died and was replaced in process (a rank SIGKILLed, its place taken by a standby) is a task that ended
        badly in a run that went on: when every rank of the world ended with one status (their end records; a standby
        the run did not need ends 0 and says nothing), that is the step's."""
        if (
            standbys
            and self.code != 0
            and self.world
            and sorted(self.exits) == list(range(self.world))
            and len(set(self.exits.values())) == 1
        ):
            return next(iter(self.exits.values()))
        return self.code


def run_over(end: dict) -> bool:
    """Whether a rank's end record ends the run, not that rank alone: rank 0's, unless a standby takes its place (it
    failed of its own error, or was counted dead: the store task serves the store, so rank 0 is replaced as any rank
    is), and any rank's that fell back to a restart."""
    cause = end.get("cause")
    if cause == "recovery-fallback":
        return True
    return int(end["rank"]) == 0 and not (end.get("outcome") == "failed" and cause in ("own", "counted-dead"))


def run_step(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    end_wait: float = 0,
    on_recovered: Callable[[], None] | None = None,
    on_node_lost: Callable[[str], None] | None = None,
    store_task: int | None = None,
    ranks: int = 0,
) -> StepEnd:
    """Run the training step (srun), its output and errors passed through line by line as they come; how it ended,
    read from srun's lines and the ranks' end records. `end_wait` > 0 (a step with standbys and its store task): the
    step is ended that many seconds after the run ended (`run_over`: rank 0's end record, or a fallback's) if it has
    not ended by itself, which is what srun's --wait does from the first task's end when standbys make a task's end,
    rank 0's included, no end of the run (`Training.standby_step`). `on_recovered` is called when a rank says it
    trained again after a recovery in process (its `recovery` record is written by then: `Training.follow_recovery`),
    `on_node_lost` with a node srun says failed (Slurm dropped it from the job: `Training.fence`). `store_task`: the
    task that serves the job's store (the step's last), whose end (srun naming it alone) before the run's is said in
    one line, and ends the step where it came before the store served (`store_task_ended`); with it, a rank's (tasks
    0 to `ranks` - 1) before the ranks formed their group ends the step too (`rank_ended_early`)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as why:
        warn(f"{argv[0]}: {one_line(why)}")
        return StepEnd(127)
    ended: list[tuple[str, int]] = []
    left: dict[str, int] = {}
    step = StepEnd(0)
    run_ended = threading.Event()
    guard: list[int] = []  # the status to report once the step was ended: by the wait after the run's end, or the store task's end
    serving = threading.Event()  # the store task said it serves the job's store
    formed = threading.Event()  # a rank said it started: the ranks formed their group
    stopping = threading.Event()  # srun or slurmstepd said the step is being ended
    first = threading.Lock()  # one early end a step (EarlyEnd): srun names each node's tasks on a line of its own

    def copy(stream: object, fd: int) -> None:
        for line in stream:  # type: ignore[attr-defined]
            data = line
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(fd, data) :]
            found = TASK_ENDED.match(line)
            if found and not found.group(3).startswith(NOT_A_CRASH):
                ids = task_ids(found.group(2))
                node, status = found.group(1).decode("ascii"), found.group(3).decode("ascii", "replace").strip()
                ended.append((node, len(ids)))
                early = EarlyEnd(proc, status, (stopping, run_ended), guard, first)
                if store_task is not None and ids == [store_task]:  # with others, srun is ending the step itself
                    args = (early, f"task {store_task} on {node}", serving)
                    threading.Thread(target=store_task_ended, args=args, name="ddpack-step-store", daemon=True).start()
                elif store_task is not None and ids and min(ids) < ranks and store_task not in ids and status not in STOP_STATUSES:
                    args = (early, f"{found.group(2).decode('ascii')} on {node}", formed)
                    threading.Thread(target=rank_ended_early, args=args, name="ddpack-step-rank", daemon=True).start()
            if STORE_SERVING_MARK in line:
                serving.set()
            if GROUP_FORMED_MARK in line:
                formed.set()
            if STEP_STOPPING.search(line):
                stopping.set()
            if (at := line.find(STANDBY_END_MARK)) >= 0:
                standby_left(step, line[at + len(STANDBY_END_MARK) :])
            if on_recovered is not None and RECOVERED_MARK in line:
                on_recovered()
            if on_node_lost is not None and (failed := NODE_FAILED.search(line)):
                on_node_lost(failed.group(1).decode("ascii"))
            at = line.find(END_MARK)
            if at >= 0:
                with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                    end = json.loads(line[at + len(END_MARK) :])
                    if left_by_a_peer(end):
                        left[str(end["host"])] = left.get(str(end["host"]), 0) + 1
                    step.exits[int(end["rank"])] = int(end["exit_code"])
                    step.world = int(end["world_size"])
                    if run_over(end):
                        run_ended.set()

    readers = [
        threading.Thread(target=copy, args=(stream, fd), name=f"ddpack-step-{fd}", daemon=True)
        for stream, fd in ((proc.stdout, 1), (proc.stderr, 2))
    ]
    for reader in readers:
        reader.start()
    if end_wait > 0:
        threading.Thread(target=end_after_run, args=(proc, run_ended, end_wait, guard), name="ddpack-step-wait", daemon=True).start()
    step.code = proc.wait()
    run_ended.set()  # the step is over: the waiting thread ends
    if guard:
        step.code = guard[0]  # a task killed (137), as srun's --wait kills it (its own status on SIGTERM is no preemption's)
    for reader in readers:
        reader.join(timeout=5)  # a process the step left behind may hold a pipe open: never wait on it for long
    step.crashed = crashed_node(ended, left)
    return step


@dataclasses.dataclass(frozen=True)
class EarlyEnd:
    """What ending the step before the run's end needs, for a task srun said ended badly with `status`: the step (srun),
    the events that make that end harmless (`watch`: the step being stopped, the run over), where the status to report
    goes (`ended`, run_step's guard) and the lock that lets one line's thread alone end it (`first`)."""

    proc: subprocess.Popen
    status: str
    watch: tuple[threading.Event, ...]
    ended: list[int]
    first: threading.Lock

    def moot(self) -> bool:
        """The step is being stopped, the run is over, or srun ended the step itself."""
        return any(event.is_set() for event in self.watch) or self.proc.poll() is not None

    def end(self, line: str) -> None:
        """Say `line` and end the step, 137 (a failed step's, restarted under DDPACK_MAX_FAILURE_RESTARTS) or 2 where
        the task refused its input; unless another line's thread (or the wait after the run's end) ended it."""
        if not self.first.acquire(blocking=False) or self.ended:
            return
        say(line)
        self.ended.append(2 if self.status == BAD_INPUT else 137)
        end_step(self.proc)


def store_task_ended(early: EarlyEnd, task: str, serving: threading.Event) -> None:
    """srun says the step's store task (`task`: "task N on NODE"), and it alone, ended badly. Before the run's end and
    before it served the store (its line awaited SERVING_LINE_WAIT_S), no rank can form a group: each waits for the
    store until its collective timeout (300 s by default), so the step is ended now. Once it served, the ranks train on
    (their group needs no store once formed) and only recovery is lost: a rank's death then ends the run as without
    standbys, and the job restarts it."""
    served = serving.wait(SERVING_LINE_WAIT_S)
    if early.moot():
        return
    if served:
        say(
            f"the job's store task ({task}) ended ({early.status}): the run goes on without in-process recovery; a rank's "
            "death now restarts the step"
        )
        return
    early.end(
        f"the job's store task ({task}) ended before it served the job's store ({early.status}; its lines above say why): "
        "no rank can start without it; ending the step"
    )


def rank_ended_early(early: EarlyEnd, tasks: str, formed: threading.Event) -> None:
    """srun says ranks' tasks (`tasks`: "LIST on NODE") ended badly before any rank said it started: before the ranks
    formed their group, where a standby cannot take a place (a recovery replaces a rank of a group that formed), and the
    other ranks wait for the dead one until their collective timeout (300 s by default). So the step is ended now; not
    where the step is being stopped, the run is over, or srun ended it itself; never for a stop's signal (STOP_STATUSES:
    the caller's). A line that names a standby with ranks (one node's, killed together) counts; one that names the
    store task too is srun ending the step."""
    if formed.wait(GROUP_LINE_WAIT_S) or early.moot():
        return
    early.end(
        f"rank task(s) {tasks} ended before the ranks formed their group ({early.status}; its lines above say why): a "
        "standby takes a place only in a group that formed, and the others would wait for it; ending the step"
    )


def standby_left(step: StepEnd, text: bytes) -> None:
    """A standby's leaving record (it never took a rank): one line of the job's log naming it, its node and why, and the
    record kept with the step's end. A line that is not one is passed through as it came, and nothing more."""
    try:
        record = json.loads(text)
        member, host, why, detail = (" ".join(str(record[k]).split())[:200] for k in ("member", "host", "why", "detail"))
    except (ValueError, KeyError, TypeError):
        return
    step.standbys_left.append(record)
    say(f"standby {member} on {host} left ({why}): {detail}")


def end_after_run(proc: subprocess.Popen, run_ended: threading.Event, wait_s: float, ended: list[int]) -> None:
    """End the step `wait_s` seconds after the run ended (`run_over`), if it is still running: a task still alive then
    is a rank frozen (SIGSTOP, a hung driver) that the standbys replaced, or a standby or store task that cannot leave."""
    run_ended.wait()
    try:
        proc.wait(timeout=wait_s)
        return
    except subprocess.TimeoutExpired:
        pass
    say(
        f"the run ended {wait_s:g} s ago and the step has not (a task frozen, or a standby that cannot leave): ending it (DDPACK_STEP_WAIT)"
    )
    ended.append(137)
    end_step(proc)


def end_step(proc: subprocess.Popen) -> None:
    """srun ends its tasks on SIGTERM; KILL follows when it does not leave."""
    with contextlib.suppress(OSError):
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            proc.kill()


def left_by_a_peer(end: dict) -> bool:
    """Whether a rank's end record says it crashed nothing: its cause, or (an older image's) its reason's words."""
    if "cause" in end:
        return end["cause"] in NOT_CRASHED
    reason = str(end.get("reason") or "")
    return reason.startswith((LEFT_BY_A_PEER, RECOVERY_FALLBACK))
