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
- The store answers anyone who can reach its port, other users of a shared cluster included (torch's TCPStore
  has no authentication, and `list_keys` names every key). So under the templates every value is signed with
  the job's secret (DDPACK_JOB_TOKEN, which only the job's ranks have) over its whole key, and every value
  read is checked before it is believed: signature, size, JSON shape, a heartbeat's host against the rank's
  own (from the process group). A bad value is ignored with one line; the watchdog thread never dies of one.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from entrypoint.atomic_file import write_atomically
from entrypoint.plan import JOB_TOKEN_VAR, job_token
from train.forensics import kill_workers, prepare_worker_stacks, remove_stacks_dir, write_rank_evidence
from train.job_keys import HOSTNAME, BadValue, Signer, store_prefix
from train.outcome import RunEnd
from train.run_folder import SUMMARY, UNRESPONSIVE_NODES, rank_stacks

EXIT_HANG = 124  # as timeout(1): the run was ended for taking too long
MAX_HEARTBEAT_BYTES = 4096  # one is ~200 bytes
T = TypeVar("T")


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

    @classmethod
    def from_json(cls, text: str, *, rank: int, host: str | None) -> Heartbeat:
        """Rank `rank`'s heartbeat as the store holds it, checked field by field (BadValue otherwise): the
        watchdog's verdicts, its summary and unresponsive-nodes are built from these. `host`: the rank's host
        as the process group has it (None before it is known), which the heartbeat must name."""
        if len(text) > MAX_HEARTBEAT_BYTES:
            raise BadValue(f"a heartbeat of {len(text)} bytes; expected at most {MAX_HEARTBEAT_BYTES}")
        data = _json_object(text)
        expected = [f.name for f in fields(cls)]
        if sorted(data) != sorted(expected):
            raise BadValue(f"a heartbeat with the fields {sorted(data)[:12]}; expected {sorted(expected)}")
        if _integer(data, "rank", 0, 2**31 - 1) != rank:
            raise BadValue(f"rank {rank}'s heartbeat says rank {data['rank']}")
        beat_host = data["host"]
        if not (isinstance(beat_host, str) and HOSTNAME.fullmatch(beat_host)):
            raise BadValue(f"a heartbeat's host {str(beat_host)[:80]!r} is not a host name")
        if host is not None and beat_host != host:
            raise BadValue(f"rank {rank}'s heartbeat names host {beat_host!r}; the process group has it on {host!r}")
        if data["phase"] not in PHASES:
            raise BadValue(f"a heartbeat's phase {str(data['phase'])[:40]!r} is not one of {', '.join(PHASES)}")
        return cls(
            rank=rank,
            host=beat_host,
            pid=_integer(data, "pid", 1, 2**31 - 1),
            sent=_seconds(data, "sent"),
            step=_integer(data, "step", 0, 2**63 - 1),
            phase=data["phase"],
            phase_s=_seconds(data, "phase_s"),
            stalled_s=_seconds(data, "stalled_s"),
        )


def _json_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: thousands of nested brackets
        raise BadValue(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise BadValue(f"JSON {type(data).__name__}; expected an object")
    return data


def _integer(data: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = data.get(name)
    if type(value) is not int or not low <= value <= high:  # type(): True is an int to isinstance
        raise BadValue(f"{name}={str(value)[:40]!r}; expected an integer in {low}..{high}")
    return value


def _seconds(data: Mapping[str, Any], name: str) -> float:
    """Seconds (a duration, or a time since the epoch): finite, >= 0 and below year 2500."""
    value = data.get(name)
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value < 1.7e10:
        raise BadValue(f"{name}={str(value)[:40]!r}; expected a number of seconds >= 0")
    return float(value)


def hang_mark(text: str, world_size: int) -> int:
    """The rank that declared the hang, from the store's mark (BadValue when it is not one a rank wrote)."""
    if len(text) > 1024:
        raise BadValue(f"a hang mark of {len(text)} bytes; expected at most 1024")
    data = _json_object(text)
    _seconds(data, "time")
    return _integer(data, "rank", 0, world_size - 1)


def shared_summary(text: str) -> dict[str, Any]:
    """The summary the writing rank shared through the store: what a rank that did not write it logs (`behind`)."""
    data = _json_object(text)
    behind = data.get("behind")
    if not (isinstance(behind, list) and all(isinstance(line, str) and len(line) <= 1000 for line in behind)):
        raise BadValue("a summary whose 'behind' is not a list of lines")
    return data


def marker(text: str) -> bool:
    """A rank's "I dumped my stacks" or "I read the summary"."""
    if text != "1":
        raise BadValue(f"a marker {text[:40]!r}; expected '1'")
    return True


MISSES_FOR_GONE = 3  # store calls in a row that miss their deadline (or fail) before the store counts as gone


class GuardedStore:
    """The rendezvous store on a connection of its own, every call with a deadline; after MISSES_FOR_GONE calls in a
    row miss it (or fail) the store counts as gone: one slow answer from a busy store host is a call without an
    answer, not the end of the store (a call still stuck keeps the helper thread: it is a daemon).

    With `token` (the job's secret), every value is written as `HMAC-SHA256(token, key + newline + value)` in
    hex, a space, then the value, and a value read back must carry the right one: the store answers any user
    who can reach its port, and the signature, over the whole key (the start's scope included), is what they
    cannot make, nor copy from one key or one start to another. Without a token (one user's machine) values
    are written and read as they are."""

    def __init__(self, connect: Callable[[], Any], deadline_s: float, prefix: str, token: str | None = None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpack-watchdog-store")
        self.deadline_s, self.prefix, self.gone = deadline_s, prefix, False
        self.misses = 0  # calls in a row without an answer
        self.missed = 0  # calls without an answer, ever: a reader tells "no answer" from "no value" by it
        self._pending: concurrent.futures.Future[Any] | None = None
        self._signer = Signer(token)
        self._store = self._call(connect)
        if self._store is None:
            self.gone = True  # never connected: nothing to call again

    @property
    def signed(self) -> bool:
        return self._signer.signed

    def close(self) -> None:
        """No call from here on, the helper thread done with its last (unless one missed its deadline and is stuck:
        then it is left, as before), and the client dropped in the caller's thread, before the process group goes."""
        stuck = self._pending is not None and not self._pending.done()
        self._pool.shutdown(wait=not (self.gone or stuck), cancel_futures=True)
        self.gone, self._store = True, None

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.gone:
            return None
        self._pending = self._pool.submit(fn, *args)
        try:
            answer = self._pending.result(timeout=self.deadline_s)
        except Exception:  # a deadline missed or the connection refused: no answer to this call
            self._pending.cancel()  # one still queued behind a stuck call must not run late (an old heartbeat after a new one)
            self.misses, self.missed = self.misses + 1, self.missed + 1
            self.gone = self.misses >= MISSES_FOR_GONE
            return None
        self.misses = 0
        return answer

    def set(self, key: str, value: str) -> None:
        if self._store is not None:
            full = self.prefix + key
            self._call(self._store.set, full, self._signer.seal(full, value))

    def get(self, key: str) -> str | None:
        """The value, or None when the key is not there (never waits for it); BadValue when what is there
        is too large, not text, or not signed with this job's token."""
        if self._store is None or not self._call(self._store.check, [self.prefix + key]):
            return None
        raw = self._call(self._store.get, self.prefix + key)
        return None if raw is None else self._signer.open(self.prefix + key, raw)


def tcp_store(deadline_s: float) -> Callable[[], Any]:
    """A client of the store the process group rendezvoused on (rank 0's under srun and docker, torchrun's
    agent's under torchrun): MASTER_ADDR/MASTER_PORT name it in both."""

    def connect() -> Any:
        import torch.distributed as dist

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=deadline_s), wait_for_workers=False)

    return connect


def job_store(environ: Mapping[str, str], *, name: str, deadline_s: float, connect: Callable[[], Any] | None = None) -> GuardedStore:
    """The watchdog's store for this rank of this job: the rendezvous store (or `connect`), under the job's
    prefix, signed with DDPACK_JOB_TOKEN when the job has one (PlanError when it is malformed: the callers
    check it first and exit 2)."""
    token = job_token(environ)
    return GuardedStore(connect or tcp_store(deadline_s), deadline_s, prefix=store_prefix(name, environ, token), token=token)


def unsigned_store_note(environ: Mapping[str, str]) -> str | None:
    """A line for rank 0 when a Slurm job runs without a token: on a shared cluster, another user who reaches
    the store could end the job as hung. The ddpack templates always set one; a job script of the user's own
    may not. None elsewhere (docker, torchrun by hand: one user's machine), where it would only be noise."""
    if environ.get(JOB_TOKEN_VAR) is not None or not (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")):
        return None
    return (
        f"watchdog: {JOB_TOKEN_VAR} is not set, so the hang watchdog's store values are not signed and another "
        "user who reaches the rendezvous port could end this job as hung; the ddpack job templates set it"
    )


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
    behind += [
        f"rank {r} on {live[r].host} (pid {live[r].pid}): in {live[r].phase} after step {live[r].step} for {live[r].phase_s:.0f}s"
        for r in late
    ]
    ranks = {
        str(r): {**asdict(b), "heartbeat_age_s": round(b.age(now), 1), "stalled_s": round(b.stalled_by(now, stale_after), 1)}
        for r, b in sorted(beats.items())
    }
    unresponsive = sorted({beats[r].host for r in stale})
    summary = {
        "hang_timeout_s": timeout_s,
        "behind": behind,
        "behind_ranks": missing + stale + late,
        "unresponsive_nodes": unresponsive,
        "ranks": ranks,
    }
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
        rank_hosts: Sequence[str] | None = None,
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
        self._latest: dict[int, Heartbeat] = {}  # the freshest heartbeat read from each peer
        self.unknown: list[int] = []  # peers whose heartbeat the last read could not take as evidence (_beats)
        self._warned: set[str] = set()
        self.rank_hosts: Sequence[str] | None = None
        if rank_hosts is not None:
            self.know_hosts(rank_hosts)

    def know_hosts(self, hosts: Sequence[str]) -> None:
        """Every rank's host, in rank order, as the ranks gathered them through the process group (not the
        store): from here on a peer's heartbeat must name its own, so that only hosts of this job's ranks can
        reach the summary and unresponsive-nodes."""
        if len(hosts) == self.world_size:
            self.rank_hosts = tuple(hosts)
            self._latest = {r: beat for r, beat in self._latest.items() if beat.host == hosts[r]}  # read before: checked again

    def start(self) -> None:
        prepare_worker_stacks()  # before the trainer's DataLoader starts its workers, which inherit its name
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        """No more checks, and none in flight when this returns: the program goes on to tear down its process group,
        whose rank 0 hosts the store, and to exit. A store request of this thread's still open then ended a finished
        rank in std::terminate (exit 134, "terminate called without an active exception"; once in CI)."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.tick + self.store.deadline_s + 1.0)  # a check's store calls each end by their deadline
        self.store.close()
        remove_stacks_dir()

    def yield_to_a_declared_hang(self) -> None:
        """Called when a collective failed. Once a hang is declared, the ranks that read the verdict exit,
        and their peers' pending collectives fail with "connection closed": that failure is the hang's
        consequence, so this rank waits here while its watchdog (which notices the declaration within a
        tick) ends it with the hang's exit code, record and evidence, instead of recording a second,
        misleading end. Returns at once when no hang was declared (a peer really died)."""
        if not self._ending.is_set() and self._declared() is None:
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
        """Every rank's latest heartbeat: this rank's own, and each peer's freshest yet, read now. Only a key that
        still holds the rank's freshest heartbeat is evidence: a frozen rank leaves its last one in place. A key
        gone missing, one that holds an older heartbeat than one already read (a replay: a rank's own clock only
        moves on) or a value that is not the rank's, is what anyone who reaches the store can make, and a call
        without an answer says nothing: such a rank is in `self.unknown` (no verdict while there is one) and out
        of the heartbeats returned, so it is never named stale."""
        beats = {self.rank: self._heartbeat()}
        self.unknown = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            host = self.rank_hosts[r] if self.rank_hosts is not None else None
            missed = self.store.missed
            beat = self._read(f"hb/{r}", lambda text, r=r, host=host: Heartbeat.from_json(text, rank=r, host=host))
            known = self._latest.get(r)
            if beat is not None and (known is None or beat.sent >= known.sent):
                self._latest[r] = beat
                beats[r] = beat
                continue
            self.unknown.append(r)
            if self.store.missed == missed and known is not None:
                self._warn_once(
                    "tampered",
                    f"watchdog: rank {r}'s heartbeat in the rendezvous store was removed or replaced by another user's write; "
                    "not counted as a stall (a real hang then ends at the collective timeout); later ones without a line",
                )
        return beats

    def _read(self, key: str, parse: Callable[[str], T]) -> T | None:
        """The value under `key` as `parse` makes it, or None when there is none or it is bad (not signed
        with the job's token, not the shape the ranks write): a bad one is ignored, with a line for the first."""
        try:
            text = self.store.get(key)
            return None if text is None else parse(text)
        except BadValue as exc:
            self._warn_once(
                "bad value", f"watchdog: ignoring the rendezvous store's value under {key!r}: {exc}; later bad ones without a line"
            )
            return None

    def _declared(self) -> int | None:
        """The rank that declared the job hung, or None."""
        return self._read("hang", lambda text: hang_mark(text, self.world_size))

    def _warn_once(self, kind: str, line: str) -> None:
        """A line per kind of trouble, not per tick: the watchdog looks every tick, for as long as the run lasts."""
        if kind not in self._warned:
            self._warned.add(kind)
            self.log(line)

    def _run(self) -> None:
        while not self._stopped.wait(self.tick):
            try:
                why = self._check()
            except Exception as exc:  # never a dead watchdog: a hang after this would end no rank, with no evidence
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                self._warn_once(
                    "check failed", f"watchdog: a check failed ({type(exc).__name__}: {first}); it goes on, later failures without a line"
                )
                continue
            if why is not None:
                self._end_surely(why)
                return

    def _check(self) -> str | None:
        """One tick: publish this rank's heartbeat, then why the job must end (None: it goes on)."""
        self._beat()
        declared = self._declared()
        if declared is not None:
            return f"rank {declared} found the job hung"
        if self.progress.stalled_s(time.monotonic()) <= self.timeout_s:
            return None
        if self.store.gone:
            return "the rendezvous store stopped answering (its host may be stopped or lost)"
        now = time.time()
        beats = self._beats()
        if self.unknown:  # a rank whose heartbeat cannot be read as its own: no evidence that it stalled
            return None
        if all(b.stalled_by(now, self.stale_after) > self.timeout_s for b in beats.values()):
            self.store.set("hang", json.dumps({"rank": self.rank, "time": now}))
            return f"no rank finished a step for {self.timeout_s:g}s"
        return None

    def _end_surely(self, why: str) -> None:
        """`_end`, and the rank ends as hung even when writing the evidence fails (a full disk, a bad summary)."""
        try:
            self._end(why)
        except Exception as exc:
            self.log(f"hang: {why}; the evidence could not be written ({type(exc).__name__}: {exc}); exiting {EXIT_HANG}")
            self._exit(EXIT_HANG)

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
            dumped = [r for r in live if r == self.rank or self._read(f"dumped/{r}", marker) is not None]
            if writer == self.rank and (dumped == live or time.monotonic() > deadline or self.store.gone):
                verdict = judge(beats, self.world_size, now, self.stale_after, self.timeout_s)
                stacks = {str(r): rank_stacks(r) for r in range(self.world_size) if (self.forensics_dir / rank_stacks(r)).exists()}
                summary = {**verdict.summary, "reason": why, "written_by": self.rank, "time": now, "stacks": stacks}
                if not write_atomically(path, json.dumps(summary, indent=1) + "\n", exclusive=True):
                    continue  # another rank's came first: that one stands
                if summary["unresponsive_nodes"]:  # for the job script, which keeps them out of a retry
                    write_atomically(self.forensics_dir / UNRESPONSIVE_NODES, "".join(f"{n}\n" for n in summary["unresponsive_nodes"]))
                self.on_hang(summary)
                self.store.set("summary", json.dumps(summary))
                others = [r for r in live if r != self.rank]
                until = time.monotonic() + 2 * self.tick + 2
                while others and time.monotonic() < until and not self.store.gone:
                    others = [r for r in others if self._read(f"read/{r}", marker) is None]
                    time.sleep(0.1)
                return summary
            if writer != self.rank:
                shared = self._read("summary", shared_summary)
                if shared is not None:
                    self.store.set(f"read/{self.rank}", "1")
                    return shared
                if time.monotonic() > deadline + 5:
                    return {}
            time.sleep(min(self.tick, 0.5))


def start_watchdog(
    progress: Progress,
    *,
    store_name: str,
    rank: int,
    world_size: int,
    host: str,
    timeout_s: float,
    forensics_dir: Path,
    log: Callable[[str], None],
    on_end: Callable[[RunEnd], None],
    rank_hosts: Sequence[str] | None = None,
) -> Watchdog:
    """The one way a training process starts its watchdog (`python -m train` and ddpack_run alike): the job's store on a
    connection of its own, each call's deadline a third of the hang timeout (2 to 10 s), rank 0's line when the store's
    values go unsigned, and the thread started."""
    store = job_store(os.environ, name=store_name, deadline_s=min(10.0, max(2.0, timeout_s / 3)))
    if rank == 0 and (note := unsigned_store_note(os.environ)) is not None:
        log(note)
    watchdog = Watchdog(
        progress, rank=rank, world_size=world_size, host=host, timeout_s=timeout_s, forensics_dir=forensics_dir, log=log, store=store,
        rank_hosts=rank_hosts, on_end=on_end,
    )  # fmt: skip
    watchdog.start()
    return watchdog
