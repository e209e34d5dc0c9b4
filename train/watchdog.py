"""Hang watchdog: a rank whose step stops finishing ends the job on every rank, with evidence.

Why: a rank stuck in data loading, in user code or in a collective holds every other rank in its next
all-reduce until the collective timeout, and then every rank says only that "a peer died". Which rank,
on which host, stuck where, is what the user needs to fix it, and it is gone once the job is.

How:
- The training thread marks where it is (`Progress.enter(phase)`, `Progress.step_done(step)`): two
  attribute stores and a clock read per phase, nothing per step that waits or talks to a peer.
- A daemon thread on every rank publishes a heartbeat (step, phase, seconds without progress) to the
  rendezvous store every `tick`, on a connection of its own: outside the collectives, so a stuck
  collective cannot hide it. Store calls run in a helper thread with a deadline, because a store whose
  host is stopped never answers (measured: TCPStore.check blocked past its own 3 s timeout).
- A rank whose own step has not finished for `timeout_s` reads every heartbeat. The job is hung when
  no rank has made progress for `timeout_s`: a rank in an untimed phase (set-up and the first step,
  which may compile; a snapshot write; eval) counts as making progress while its heartbeat is fresh,
  so peers waiting on rank 0's eval in their next collective do not fire. A rank whose heartbeat went
  stale (SIGSTOP, a frozen or lost node) makes no progress.
- The first rank to decide marks the store; every live rank then writes its own stacks (all threads,
  and its DataLoader workers', which dump themselves on SIGUSR2 through faulthandler), on NCCL torch's
  flight recorder; rank 0 (or, when rank 0 or the store is gone, the lowest rank still answering) waits
  for them and writes `summary.json` naming the ranks and hosts that fell behind; each rank prints one
  line saying where the evidence is and exits EXIT_HANG.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from train.forensics import kill_workers, remove_stacks_dir, write_atomic, write_rank_evidence
from train.outcome import RunEnd
from train.run_folder import SUMMARY, UNRESPONSIVE_NODES, rank_stacks

EXIT_HANG = 124  # as timeout(1): the run was ended for taking too long


class Phase:
    """Where a rank's training thread is, as the trainer and ddpack_run mark it (`Progress.enter(Phase.DATA)`)
    and heartbeats carry it: plain strings, so that a heartbeat is JSON and a mark costs one attribute store;
    named here, so that a misspelt phase fails where it is written instead of never matching."""

    SETUP = "setup"
    DATA = "data"  # waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"  # with DDP, the gradients' all-reduce overlaps it
    SYNC = "sync"  # waiting for the last of the all-reduce
    OPTIMIZER = "optimizer"
    METRICS = "metrics"  # a progress line's all-reduce
    STEP_END = "step-end"
    SNAPSHOT_GATHER = "snapshot-gather"  # the ranks' RNG states to rank 0: a collective, so timed
    SNAPSHOT = "snapshot"
    EVAL = "eval"
    FINISH = "finish"


# Phases in step order: a rank in an earlier phase after the same step is behind the others.
PHASES = tuple(value for name, value in vars(Phase).items() if name.isupper())
# Legitimately long and not a hang while the rank's heartbeat is fresh; the first step is untimed too.
# None of them may wait on a peer: a rank blocked in a collective would count as making progress, and a
# frozen peer would never be found (the snapshot's gather of the ranks' RNG states is timed for this).
UNTIMED = frozenset({Phase.SETUP, Phase.SNAPSHOT, Phase.EVAL})


class Progress:
    """Where this rank's training thread is; read by the watchdog thread (plain attributes: a store of
    a Python reference is atomic)."""

    __slots__ = ("armed", "phase", "phase_at", "progress_at", "step")

    def __init__(self) -> None:
        self.step = 0
        self.phase = Phase.SETUP
        self.phase_at = self.progress_at = time.monotonic()
        self.armed = False  # after the first step finished in this process: it may compile, warm up, resume

    def enter(self, phase: str) -> None:
        """A timed phase, from a timed one (the step's own: ~0.2 us)."""
        self.phase, self.phase_at = phase, time.monotonic()

    def enter_counted(self, phase: str) -> None:
        """`phase`, counted as progress: how the trainer goes into an untimed phase and out of it again."""
        self.phase = phase
        self.phase_at = self.progress_at = time.monotonic()

    def step_done(self, step: int) -> None:
        self.step, self.progress_at, self.armed = step, time.monotonic(), True

    def stalled_s(self, now: float) -> float:
        """Seconds without progress: 0 in an untimed phase or before the first step finished."""
        if not self.armed or self.phase in UNTIMED:
            return 0.0
        return now - self.progress_at


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    rank: int
    host: str
    pid: int
    sent: float  # wall clock (seconds since the epoch): heartbeats cross hosts, whose clocks NTP keeps close
    step: int
    phase: str
    phase_s: float
    stalled_s: float

    def age(self, now: float) -> float:
        return max(0.0, now - self.sent)

    def stalled_by(self, now: float, stale_after: float) -> float:
        """Seconds without progress as of `now`; a stale heartbeat's rank made none since it was sent."""
        if self.phase in UNTIMED and self.age(now) <= stale_after:
            return 0.0
        return self.stalled_s + self.age(now)

    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else 0


class GuardedStore:
    """The rendezvous store on a connection of its own, every call with a deadline; after one call
    misses it the store counts as gone (the helper thread may stay blocked: it is a daemon)."""

    def __init__(self, connect: Callable[[], Any], deadline_s: float, prefix: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpack-watchdog-store")
        self.deadline_s, self.prefix, self.gone = deadline_s, prefix, False
        self._store = self._call(connect)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.gone:
            return None
        try:
            return self._pool.submit(fn, *args).result(timeout=self.deadline_s)
        except Exception:  # a deadline missed or the connection refused: either way, no store from here on
            self.gone = True
            return None

    def set(self, key: str, value: str) -> None:
        if self._store is not None:
            self._call(self._store.set, self.prefix + key, value)

    def get(self, key: str) -> str | None:
        """The value, or None when the key is not there (never waits for it)."""
        if self._store is None or not self._call(self._store.check, [self.prefix + key]):
            return None
        value = self._call(self._store.get, self.prefix + key)
        return value.decode() if value is not None else None


def tcp_store(deadline_s: float) -> Callable[[], Any]:
    """A client of the store the process group rendezvoused on (rank 0's under srun and docker, torchrun's
    agent's under torchrun): MASTER_ADDR/MASTER_PORT name it in both."""

    def connect() -> Any:
        import torch.distributed as dist

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=deadline_s), wait_for_workers=False)

    return connect


# ---------------------------------------------------------------- the watchdog


@dataclass(frozen=True)
class Verdict:
    """Who fell behind, from the heartbeats; `summary` is what summary.json holds."""

    behind: list[str]
    summary: dict[str, Any]


def judge(beats: dict[int, Heartbeat], world_size: int, now: float, stale_after: float, timeout_s: float) -> Verdict:
    """The ranks that fell behind: those whose heartbeat went stale or never came (stopped, frozen, lost),
    and among the live ones those at the earliest position (last step, then phase) when not all share it."""
    missing = [r for r in range(world_size) if r not in beats]
    stale = sorted(r for r, b in beats.items() if b.age(now) > stale_after)
    live = {r: b for r, b in beats.items() if r not in stale}
    earliest = min((b.position() for b in live.values()), default=None)
    late = sorted(r for r, b in live.items() if b.position() == earliest) if len({b.position() for b in live.values()}) > 1 else []
    behind = [f"rank {r}: no heartbeat from it (it never started the watchdog, or the store lost it)" for r in missing]
    behind += [
        f"rank {r} on {beats[r].host} (pid {beats[r].pid}): no heartbeat for {beats[r].age(now):.0f}s "
        f"(stopped, frozen or lost), last in {beats[r].phase} after step {beats[r].step}"
        for r in stale
    ]
    behind += [f"rank {r} on {live[r].host} (pid {live[r].pid}): in {live[r].phase} after step {live[r].step} for {live[r].phase_s:.0f}s" for r in late]
    ranks = {
        str(r): {**asdict(b), "heartbeat_age_s": round(b.age(now), 1), "stalled_s": round(b.stalled_by(now, stale_after), 1)}
        for r, b in sorted(beats.items())
    }
    unresponsive = sorted({beats[r].host for r in stale})
    summary = {"hang_timeout_s": timeout_s, "behind": behind, "behind_ranks": missing + stale + late, "unresponsive_nodes": unresponsive, "ranks": ranks}
    return Verdict(behind, summary)


class Watchdog:
    """One per rank; `start()` after the process group is up, `stop()` when training is over."""

    def __init__(
        self,
        progress: Progress,
        *,
        rank: int,
        world_size: int,
        host: str,
        timeout_s: float,
        forensics_dir: Path,
        log: Callable[[str], None],
        store: GuardedStore,
        on_hang: Callable[[dict[str, Any]], None] = lambda summary: None,
        on_end: Callable[[RunEnd], None] = lambda end: None,  # records the rank's end (python -m train: its record_end)
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.progress, self.rank, self.world_size, self.host = progress, rank, world_size, host
        self.timeout_s, self.forensics_dir, self.log, self.store = timeout_s, forensics_dir, log, store
        self.on_hang, self.on_end, self._exit = on_hang, on_end, exit
        self.tick = min(5.0, max(0.2, timeout_s / 10))
        self.stale_after = max(3 * self.tick, 5.0)
        self.grace_s = max(10.0, 3 * self.tick)  # how long the summary waits for the others' stacks
        self._stopped = threading.Event()
        self._ending = threading.Event()  # set once this watchdog has begun ending the rank
        self._thread = threading.Thread(target=self._run, name="ddpack-watchdog", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        remove_stacks_dir()

    def yield_to_a_declared_hang(self) -> None:
        """Called when a collective failed. Once a hang is declared, the ranks that read the verdict exit,
        and their peers' pending collectives fail with "connection closed": that failure is the hang's
        consequence, so this rank waits here while its watchdog (which notices the declaration within a
        tick) ends it with the hang's exit code, record and evidence, instead of recording a second,
        misleading end. Returns at once when no hang was declared (a peer really died)."""
        if not self._ending.is_set() and self.store.get("hang") is None:
            return
        self._ending.wait(2 * self.tick + 1)
        self._thread.join(self.grace_s + 4 * self.tick + 10)  # the watchdog exits the process; this bounds a stuck one

    # ------------------------------------------------------------ heartbeats

    def _heartbeat(self) -> Heartbeat:
        p, now = self.progress, time.monotonic()
        return Heartbeat(
            rank=self.rank,
            host=self.host,
            pid=os.getpid(),
            sent=time.time(),
            step=p.step,
            phase=p.phase,
            phase_s=round(now - p.phase_at, 2),
            stalled_s=round(p.stalled_s(now), 2),
        )

    def _beat(self) -> None:
        self.store.set(f"hb/{self.rank}", json.dumps(asdict(self._heartbeat())))

    def _beats(self) -> dict[int, Heartbeat]:
        beats = {self.rank: self._heartbeat()}
        for r in range(self.world_size):
            if r != self.rank and (text := self.store.get(f"hb/{r}")) is not None:
                beats[r] = Heartbeat(**json.loads(text))
        return beats

    def _run(self) -> None:
        while not self._stopped.wait(self.tick):
            self._beat()
            declared = self.store.get("hang")
            if declared is not None:
                self._end(f"rank {json.loads(declared)['rank']} found the job hung")
                return
            elif self.progress.stalled_s(time.monotonic()) > self.timeout_s:
                if self.store.gone:
                    self._end("the rendezvous store stopped answering (its host may be stopped or lost)")
                    return
                now = time.time()
                beats = self._beats()
                if all(b.stalled_by(now, self.stale_after) > self.timeout_s for b in beats.values()):
                    self.store.set("hang", json.dumps({"rank": self.rank, "time": now}))
                    self._end(f"no rank finished a step for {self.timeout_s:g}s")
                    return

    # ------------------------------------------------------------ the end

    def _end(self, why: str) -> None:
        if self._stopped.is_set():
            return  # training finished while we looked
        self._ending.set()
        self.forensics_dir.mkdir(parents=True, exist_ok=True)
        p, now = self.progress, time.monotonic()
        header = (
            f"rank {self.rank}/{self.world_size} host {self.host} pid {os.getpid()}: last finished step {p.step}, "
            f"in {p.phase} for {now - p.phase_at:.1f}s, {now - p.progress_at:.1f}s since progress; {why}\n"
        )
        worker_pids = write_rank_evidence(self.forensics_dir, self.rank, header)
        self.store.set(f"dumped/{self.rank}", "1")
        summary = self._summarise(why)
        behind = "; ".join(summary.get("behind", [])) or "every rank stalled at the same place (see the stacks)"
        self.log(f"hang: {why}; behind: {behind}; evidence in {self.forensics_dir} (summary.json, rank-*.txt); exiting {EXIT_HANG}")
        end = RunEnd(
            rank=self.rank,
            world_size=self.world_size,
            host=self.host,
            outcome="hung",
            exit_code=EXIT_HANG,
            global_step=p.step,
            reason=f"{why}; behind: {behind}",
            forensics=str(self.forensics_dir),
        )
        self.on_end(end)
        kill_workers(worker_pids)
        self._exit(EXIT_HANG)

    def _summarise(self, why: str) -> dict[str, Any]:
        """Rank 0, or the lowest rank answering when rank 0's heartbeat is stale, writes summary.json once
        the live ranks have dumped (or the grace ran out), then waits for them to read it before leaving
        (rank 0 may host the store); the others wait for it, as long."""
        path = self.forensics_dir / SUMMARY
        deadline = time.monotonic() + self.grace_s
        while True:
            if path.exists():  # written by another rank (a shared run folder) or by a rank that lost the store
                self.store.set(f"read/{self.rank}", "1")
                return json.loads(path.read_text())
            now = time.time()
            beats = self._beats()
            live = sorted(r for r, b in beats.items() if b.age(now) <= self.stale_after)
            writer = live[0] if live and not self.store.gone else self.rank
            dumped = [r for r in live if r == self.rank or self.store.get(f"dumped/{r}") is not None]
            if writer == self.rank and (dumped == live or time.monotonic() > deadline or self.store.gone):
                verdict = judge(beats, self.world_size, now, self.stale_after, self.timeout_s)
                stacks = {str(r): rank_stacks(r) for r in range(self.world_size) if (self.forensics_dir / rank_stacks(r)).exists()}
                summary = {**verdict.summary, "reason": why, "written_by": self.rank, "time": now, "stacks": stacks}
                if not write_atomic(path, json.dumps(summary, indent=1) + "\n", exclusive=True):
                    continue  # another rank's came first: that one stands
                if summary["unresponsive_nodes"]:  # for the job script, which keeps them out of a retry
                    write_atomic(self.forensics_dir / UNRESPONSIVE_NODES, "".join(f"{n}\n" for n in summary["unresponsive_nodes"]))
                self.on_hang(summary)
                self.store.set("summary", json.dumps(summary))
                others = [r for r in live if r != self.rank]
                until = time.monotonic() + 2 * self.tick + 2
                while others and time.monotonic() < until and not self.store.gone:
                    others = [r for r in others if self.store.get(f"read/{r}") is None]
                    time.sleep(0.1)
                return summary
            if writer != self.rank:
                shared = self.store.get("summary")
                if shared is not None:
                    self.store.set(f"read/{self.rank}", "1")
                    return json.loads(shared)
                if time.monotonic() > deadline + 5:
                    return {}
            time.sleep(min(self.tick, 0.5))
