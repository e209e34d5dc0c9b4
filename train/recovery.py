"""In-process recovery: a rank that dies costs the job one step, not a restart of every rank.

With `--recovery`, the ranks keep their processes when a peer dies; a standby (`--standby`: a process that has
started Python, imported torch and built the model, and waits on the store) takes the dead rank's place.

Who learns what, and how (the store is the one channel that never waits on a collective; every key on it is signed
with the job's token and read back checked: train/recovery_channel.py):
- Every process (rank or standby) is a *member* of the job, named `r<rank>` for the ranks it started with and
  `s<n>` for standbys (the launcher's by their task), and beats every HEARTBEAT_S on its node; the node's two writers
  put one signed value for the node in the store (every member's count, its age on the node's clock, its waiting
  count: train/node_beats.py), so the store's traffic grows with nodes, not ranks.
- Standbys watch: each reads every node's heartbeat every HEARTBEAT_S. A member that has not beaten for
  STALE_S, once a survivor has reported a failed collective (a late heartbeat on a loaded node while every collective
  completes is no death), is dead; so is one that has not beaten for FROZEN_S while a survivor has waited on one
  collective for WAITING_S (a frozen rank or a lost node: nothing resets a connection, nothing fails before the
  collective timeout). A member whose node says its process still runs (its beat late, the process neither stopped
  nor ended: train/node_beats.py) is neither: a heartbeat thread held back on a saturated node is no death. The
  first standby to see a death writes the generation's *decision* (compare-and-set, so there is one): the new roster,
  which standby takes which rank (a standby on another host than the dead rank's when one is alive), or why recovery
  cannot work (`fallback`).
- A survivor learns nothing until its collective fails, or, waiting on one (gloo's polled waits), until it sees this
  generation's decision in the store (asked every 20 ms: `abandon_if_decided`): gloo cannot cancel a collective in
  flight, so without that its timeout would be how long a survivor whose own peers live waits on a dead one.
  `CollectiveClock` sets the timeout from the steps' own measured times: `max(TIMEOUT_FLOOR_S, TIMEOUT_MARGIN x the
  slowest step seen)`, never above --collective-timeout, and the long --collective-timeout around what one rank does
  alone while the others wait (rank 0's eval and snapshot copy, the first steps of a generation). A slow but healthy
  collective raises the timeout with it.
- A failed survivor reads the decision (waiting up to DECISION_WAIT_S for it), destroys its process group
  (NCCL's communicator is aborted first, never left to its watchdog) and joins the next generation's, of the
  same world size, under the generation's own prefix; the assigned standby joins it as the dead rank.
- The state comes from a survivor: the trainer broadcasts model, optimizer and position from a rank whose last
  *confirmed* step is the greatest (a step's optimizer runs only once its all-reduce completed on that rank:
  train/grad_sync.py; a survivor whose all-reduce completed may be one step ahead of one whose did not), as
  weights_only loads read (nothing from a peer is unpickled); per-step RNG is derived from a hash of (seed, rank,
  global step), so the dead rank's stream is rebuilt, not lost.

Falls back (the rank ends `failed`, exit 1, cause recovery-fallback, with the reason; the job program restarts every
rank from the newest snapshot, as without --recovery): more ranks lost than live standbys; no standby running; the
store's host lost (the store task or its node; rank 0 without a store task); a collective failed but no member's
heartbeat stopped (a hang, or a collective slower than its timeout); a failure while re-forming the group (the chosen
standby died, another rank died).

The store: with the store task (--store-task, the job program's steps with standbys) torch's own TCPStore is served by
the launcher's last process, which trains nothing (`serve_store`), so rank 0 is a client and its death is recovered as
any rank's (its duties pass to the standby in its place, which is rank 0 from then on); the store task starts a new
standby for each one a recovery consumed (`train.standby_forker`). Without it, rank 0 hosts the store and its death falls back.

Limits: the store task's node (the first) lost takes the store with it; torchrun restarts its
workers itself, so --recovery needs one process per rank (srun tasks, docker -e); the process group's own rendezvous
keys are torch's and not signed, and another user who reaches the store can hide a live member's heartbeat (a denial
of service: docs/security.md); on NCCL a frozen peer costs the collective timeout (its waits are not polled) and the
path has not run across two GPUs; a rank hung with a live heartbeat is the watchdog's to end (--hang-timeout).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from entrypoint.plan import job_token
from train import distributed
from train.distributed import DistContext, default_to_one_process, first_line, node_name, turn_on_flight_recorder
from train.job_keys import HOSTNAME
from train.metrics import RankLog
from train.node_beats import LocalBeat, LocalBeats, this_process
from train.outcome import StandbyEnd
from train.recovery_channel import Beat, Channel, Decision, NodeBeat
from train.signals import PreemptionWatcher
from train.standby_forker import StandbyForker
from train.torch_compat import abort_default_group, set_collective_timeout

HEARTBEAT_S = 0.05  # each member bumps its counter this often; standbys sample every counter as often
STALE_S = 0.25  # a counter unchanged this long, once a survivor reported a failed collective, is a dead member
# A counter unchanged this long while a survivor waits on a collective (WAITING_S and more) is a frozen rank or a lost
# node: no connection resets, so no collective fails before its timeout (up to --collective-timeout). Wider than
# STALE_S, since nothing has failed yet: a heartbeat thread held back by a loaded node must not be taken for one.
FROZEN_S = 1.5
LATE_MS = int(2000 * HEARTBEAT_S)  # a member's beat this old (two beats missed) is checked on its node: does its process run?
WAITING_S = 0.5  # a survivor that has waited on one collective this long says so (its count rises while it waits)
# The collective timeout never goes below this. A healthy collective of a tiny model takes ~1 ms (gloo, 4 local ranks),
# but a node whose cores are shared (here: 4 ranks, a standby and a second run on 2 cores) can hold one back for
# hundreds of ms: at 0.5 s, CI's run at be269c6 saw the first step under the tightened timeout fail with every rank
# alive, twice in a row, and the job fall back to a full restart (docs/recovery.md). A timeout matters only for a
# peer that is silent but connected (a killed one closes its connections at once, and the survivors leave on the
# standbys' decision without waiting it out), so a wide floor costs a hang a second or two and a kill nothing.
TIMEOUT_FLOOR_S = 2.0
TIMEOUT_MARGIN = 20.0  # x the slowest measured step: a step's collectives never take longer than the step
MEASURED_STEPS = 5  # steps timed at the long timeout after a (re)join or a one-rank pause before tightening
DECISION_WAIT_S = 5.0  # a failed survivor waits this long for a standby's decision before falling back
JOIN_TIMEOUT_S = 20.0  # forming the next generation's group; past it, recovery failed while recovering
STORE_TIMEOUT_S = 10.0
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
T = TypeVar("T")
STORE_GONE_S = 1.0  # a standby whose store calls have all failed this long leaves: the store's host is gone
REGISTER_S = 1.0  # a node's writers say their registration again this often (a deleted one is mended)
# The store task (`serve_store`) lingers this long after the run's `closed` key while members still beat, so that the
# standbys read it and leave with a line, not on a store gone; and leaves once no member's heartbeat has risen for
# STORE_IDLE_S (every member gone without closing: killed together, or the step ended by the job program).
STORE_LINGER_S = 5.0
STORE_IDLE_S = 30.0
# The store task starts a new standby for each one a recovery consumed, at most this many in a run: a standby that
# takes a place and dies at once, again and again, ends in a fallback, not in processes started without end.
MAX_RESPAWNED = 8


class PeerDeclaredDead(RuntimeError):
    """Raised in a survivor that waits on a collective once the standbys have judged a peer dead (train.distributed's
    abandon_check): the collective will not complete, and the recovery starts now rather than at its timeout."""

    peer_failure = True  # train.distributed.collective_failure


class RecoveryImpossible(Exception):
    """In-process recovery cannot go on; the message says why (one line), the job restarts every rank."""


def collective_timeout(
    slowest_step_s: float, *, floor_s: float = TIMEOUT_FLOOR_S, margin: float = TIMEOUT_MARGIN, ceiling_s: float
) -> float:
    """The collective timeout after `slowest_step_s`, the longest step measured: a step's collectives end within
    the step, so `margin` x its length is a wait no healthy collective reaches; `floor_s` keeps a tiny model's
    sub-millisecond steps from a timeout that a scheduler tick could exceed; `ceiling_s` is --collective-timeout."""
    return min(ceiling_s, max(floor_s, margin * slowest_step_s))


def decide(
    generation: int,
    roster: Mapping[int, str],
    dead: Mapping[int, str],
    hosts: Mapping[str, str],
    standbys: list[str],
    *,
    rank0_hosts_store: bool = True,
) -> Decision:
    """Pure: the decision after `dead` (rank -> member) died in `generation`. `hosts`: member -> host; `standbys`:
    the live, unassigned standbys, oldest first. A standby on a host other than the dead rank's is preferred: the
    node that made a rank die is not where the next one starts when another place exists. The dead ranks of one node
    (a node lost: set DOWN, its tasks killed) go together to standbys all on one other node where one has enough (a
    spare node's, enroot/ddpack_training.py `task_hosts`), so the world keeps its ranks a node. `rank0_hosts_store`: the
    job's store lives in rank 0's process (no store task, `serve_store`), so rank 0's death took it down."""
    roster, dead = dict(roster), dict(dead)
    after = generation + 1
    if 0 in dead and rank0_hosts_store:
        return Decision(
            generation=after, roster=roster, dead=dead, fallback="rank 0 lost: it hosts the job's store, which the group is formed on"
        )
    if len(dead) > len(standbys):
        lost = ", ".join(str(r) for r in sorted(dead))
        alive = f"{len(standbys)} standby is alive" if len(standbys) == 1 else f"{len(standbys)} standbys are alive"
        why = (
            f"{len(dead)} rank(s) lost ({lost}) and {alive}: more ranks lost than standbys"
            if standbys
            else f"rank(s) {lost} lost and no standby is alive"
        )
        return Decision(generation=after, roster=roster, dead=dead, fallback=why)
    free, replacements = list(standbys), {}
    by_node: dict[str | None, list[int]] = {}  # the dead ranks by their node, in rank order
    for rank in sorted(dead):
        by_node.setdefault(hosts.get(dead[rank]), []).append(rank)
    for node, ranks in by_node.items():
        # A node's ranks go together to one known node with standbys enough (a spare's: as many as a node's ranks), so
        # that the new world keeps its ranks a node; else each to a standby on another node where one is left.
        counts = collections.Counter(hosts.get(s) for s in free)
        whole = next((h for h in counts if h is not None and h != node and counts[h] >= len(ranks)), None)
        for rank in ranks:
            pool = [s for s in free if hosts.get(s) == whole] if whole is not None else [s for s in free if hosts.get(s) != node]
            chosen = (pool or free)[0]
            free.remove(chosen)
            replacements[rank] = chosen
            roster[rank] = chosen
    return Decision(generation=after, roster=roster, dead=dead, replacements=replacements)


def step_seed(seed: int, rank: int, global_step: int) -> int:
    """The RNG seed of `rank`'s step `global_step` under --recovery: a pure function, so a replacement rebuilds
    the dead rank's stream (dropout...) from its position alone. A hash, not a sum: `seed*a + rank*b + step` gave
    rank r's step s + b the seed of rank r + 1's step s (the same dropout masks on two ranks, b = 7,919 steps apart)."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{global_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: what torch.manual_seed takes


def reseed(seed: int, rank: int, global_step: int) -> None:
    value = step_seed(seed, rank, global_step)
    torch.manual_seed(value)  # every device's generator too
    random.seed(value)


def _store(is_master: bool, connect_s: float = STORE_TIMEOUT_S) -> dist.TCPStore:
    """The job's store at MASTER_ADDR:MASTER_PORT, which the process group is formed on again under a new prefix at
    every recovery: hosted for the whole job by the store task (`serve_store`), or by rank 0 without one; everyone
    else is a client. A process waits `connect_s` for it (its --collective-timeout, as a rendezvous without
    --recovery does: the host may start late); every call after that has STORE_TIMEOUT_S, the bound on how long a
    lost store's host goes unnoticed."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master, timedelta(seconds=connect_s), wait_for_workers=False
    )
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


class Heartbeat:
    """A daemon thread that beats for this member every HEARTBEAT_S: its count in its node's directory
    (train/node_beats.py) and, while it is one of the node's writers, the node's signed value in the store, on a store
    connection of its own (a client is not shared between threads). So the store sees a write a node, not a member,
    every HEARTBEAT_S. A store error skips store writes for a while, never the node-local beat nor the thread: a
    heartbeat that stopped after one slow answer would make a live member look dead (it ends with the process, or `stop`).
    `waiting` is set by the rank's training thread while it waits on a collective (Membership.abandon_if_decided)."""

    def __init__(
        self, channel: Channel, member: str, host: str, connect_s: float = STORE_TIMEOUT_S, local: LocalBeats | None = None
    ) -> None:
        self.member, self.host, self.errors = member, host, 0
        self.waiting: tuple[int, int] | None = None  # (generation, a count that rises while this rank waits on a collective)
        self._stop = threading.Event()
        self._channel = channel.sibling(_store(False, connect_s))
        try:
            self._local = local or LocalBeats.open(os.environ, job_token(os.environ))
        except OSError as exc:
            raise RecoveryImpossible(
                f"in-process recovery's heartbeats cannot be written on this node ({first_line(exc)}): they live in its temp "
                "directory (TMPDIR)"
            ) from None
        self._count, self._process = 1, this_process()
        self._channel.register(member, self._local.node)  # a store that does not answer: the caller's RuntimeError
        self._registered = time.monotonic()
        self._store_from, self._failed = 0.0, 0  # no store write before this (monotonic) after `_failed` errors in a row
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ddpack-recovery-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._count += 1
            try:
                self._beat()
            except OSError:  # the node's directory went (its last member cleaned it up while this one was frozen): again
                with contextlib.suppress(OSError, RuntimeError):
                    self._local = LocalBeats.open(os.environ, job_token(os.environ), self._local.path.parent)
                    self._channel.register(self.member, self._local.node)

    def _beat(self) -> None:
        """This member's count on its node; the node's value in the store when this member is one of its writers."""
        now_ns = time.monotonic_ns()
        self._local.write(self.member, LocalBeat(self._count, now_ns, self.waiting, *self._process))
        beats = self._local.read()
        if self.member not in LocalBeats.writers(beats, now_ns) or time.monotonic() < self._store_from:
            return
        ages = {m: max(0, now_ns - b.at_ns) // 1_000_000 for m, b in beats.items()}
        # A late beat says whether its process still runs here (one /proc read, only for a late one): a live member whose
        # heartbeat thread is held back is not taken for a frozen one (Standby._silences).
        node = NodeBeat.of(
            self.host, now_ns, {m: Beat(b.count, self.host, ages[m], b.waiting, ages[m] >= LATE_MS and b.runs()) for m, b in beats.items()}
        )
        try:
            self._channel.beat_node(self._local.node, node)
            if time.monotonic() - self._registered >= REGISTER_S:  # a deleted registration is mended for later standbys
                self._channel.register(self.member, self._local.node)
                self._registered = time.monotonic()
            self._failed = 0
        except RuntimeError:  # a slow answer: a later beat tries again; a broken connection: a new one
            self.errors, self._failed = self.errors + 1, self._failed + 1
            # A store that is gone is the readers' to notice, not retried (and logged by torch) 20x a second.
            self._store_from = time.monotonic() + min(1.0, HEARTBEAT_S * 2 ** (self._failed - 1))
            if self._failed % 2 == 0:
                with contextlib.suppress(RuntimeError):
                    self._channel = self._channel.sibling(_store(False, STORE_TIMEOUT_S))

    def stop(self) -> None:
        """The beats end and this member's file on the node goes (the last member's takes the node's directory with it),
        here and not in the thread, which may be held in a store call whose host is gone when the process exits."""
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)
        self._local.leave(self.member)


# The gloo groups recovery left, held for the life of the process. A gloo group's destructor joins its threads, and one
# may still wait in a collective that a survivor abandoned (PeerDeclaredDead) on a peer that is alive and holds its own
# old group open: the join lasts until that collective's timeout. Dropped by the old DDP's reducer (a garbage
# collection, at any later moment), the destructor runs holding the interpreter's lock: on the test cluster rank 0's
# heartbeat stopped for 1.5 s after a second recovery, the standbys counted it dead, and the job fell back. Held here,
# the group is never destroyed while the run goes on; its threads idle once that collective times out.
_BROKEN_GROUPS: list[Any] = []


def tear_down(backend: str) -> None:
    """Leave a broken process group without waiting on the dead: NCCL's communicators are aborted (a kernel
    waiting on a dead peer never returns, and the watchdog would take the process down), then destroyed; a gloo group
    is unregistered and held (`_BROKEN_GROUPS`)."""
    if not dist.is_initialized():
        return
    if backend == "nccl":
        abort_default_group()
    else:
        _BROKEN_GROUPS.append(dist.group.WORLD)
    if dist.is_initialized():  # an abort may have left the group registered
        dist.destroy_process_group()


def join_group(
    store: dist.Store, *, generation: int, rank: int, world_size: int, backend: str, device: torch.device, timeout_s: float
) -> None:
    """Form generation `generation`'s process group on `store`, the generation's own prefix of the job's store
    (`Channel.group_store`: the keys of a generation that broke are never read again). On NCCL, a collective past its timeout aborts the communicators and
    raises in the training thread (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly) instead of ending the process (3,
    torch's default), which would take the survivor down with the dead; the flight recorder is on as without
    --recovery. Generation 0 forms within `timeout_s` (the job's start, where a rank may start late); a recovery's
    within JOIN_TIMEOUT_S, past which it failed while recovering."""
    if backend == "nccl":
        os.environ.setdefault(NCCL_ERROR_HANDLING, "2")
        turn_on_flight_recorder()
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=JOIN_TIMEOUT_S if generation else timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    set_collective_timeout(timeout_s)


@dataclass
class Stages:
    """Wall-clock seconds (time.time()) at each stage of one recovery, for the `recovery` record and the bench."""

    failed: float = 0.0  # the survivor's collective raised
    decided: float = 0.0  # the decision was read
    torn_down: float = 0.0
    joined: float = 0.0  # the next generation's group formed (DDP rebuilt)
    state: float = 0.0  # the state broadcast done
    first_step: float = 0.0  # the redone step finished

    def fields(self) -> dict[str, float]:
        return {
            "failed_at": self.failed,
            "decide_s": round(self.decided - self.failed, 4),
            "abort_s": round(self.torn_down - self.decided, 4),
            "new_group_s": round(self.joined - self.torn_down, 4),
            "state_s": round(self.state - self.joined, 4),
            "first_step_s": round(self.first_step - self.state, 4),
            "total_s": round(self.first_step - self.failed, 4),
        }


class Membership:
    """A rank's side: its channel, its heartbeat, its generation; `recover` after a failed collective. A rank that starts
    is `Membership.started` (generation 0); a standby given a dead rank's place keeps the channel and heartbeat it has."""

    def __init__(
        self,
        *,
        channel: Channel,
        heartbeat: Heartbeat,
        member: str,
        rank: int,
        generation: int,
        world_size: int,
        backend: str,
        device: torch.device,
        collective_timeout_s: float,
    ) -> None:
        self.channel, self.heartbeat, self.member = channel, heartbeat, member
        self.rank, self.generation, self.world_size, self.backend, self.device = rank, generation, world_size, backend, device
        self.collective_timeout_s = collective_timeout_s
        self.stages: Stages | None = None
        self.counted_dead = False  # the standbys' decision left this rank out: its end must not send the standbys away
        self._waiting, self._next_waiting = 0, 0.0  # this rank's waiting count (in its heartbeat), and when to raise it next

    @classmethod
    def started(
        cls,
        *,
        rank: int,
        host: str,
        collective_timeout_s: float,
        log: Callable[[str], None],
        launched: int = 0,
        store_task: bool = False,
        **settings: Any,
    ) -> Membership:
        """A rank of generation 0: hosts the store on rank 0 unless a store task serves it, names this rank's host to
        the standbys and starts its heartbeat."""
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            raise RecoveryImpossible(
                "--recovery needs one process per rank (srun tasks, docker -e); under torchrun its agent restarts every worker"
            )
        channel = Channel.of_job(_store(rank == 0 and not store_task, connect_s=collective_timeout_s), os.environ, log, launched=launched)
        member = f"r{rank}"
        heartbeat = Heartbeat(channel, member, host, connect_s=collective_timeout_s)
        return cls(
            channel=channel,
            heartbeat=heartbeat,
            member=member,
            rank=rank,
            generation=0,
            collective_timeout_s=collective_timeout_s,
            **settings,
        )

    def abandon_if_decided(self, waited_s: float = 0.0) -> None:
        """While this rank waits on a collective (train.distributed.wait_polling): when this generation's decision is
        written, a peer was judged dead (a survivor next to it failed at once and the standbys decided), so the
        collective cannot complete: raise now, instead of waiting out the collective timeout, which gloo cannot cut.
        Only a decision signed by one of this job's standbys counts: another user's `set` is ignored with a line."""
        try:
            if waited_s >= WAITING_S and (now := time.monotonic()) >= self._next_waiting:
                self._next_waiting, self._waiting = now + 2 * HEARTBEAT_S, self._waiting + 1
                self.heartbeat.waiting = (self.generation, self._waiting)  # in this rank's next beats, for the standbys
            decided = self.channel.decided(self.generation, self.world_size)
        except RuntimeError:
            return  # the store's own failure: recover() says it when the collective fails
        if decided:
            raise PeerDeclaredDead(f"a peer was judged dead in generation {self.generation} while this rank waited on a collective")

    def watch_collectives(self) -> None:
        """Let this rank's collective waits end early on a decision (see abandon_if_decided)."""
        distributed.abandon_check = self.abandon_if_decided

    @property
    def replacing(self) -> bool:
        """This process is a standby that took a dead rank's place (its state comes from the survivors)."""
        return self.member.startswith("s")

    def join(self) -> None:
        self.watch_collectives()
        join_group(
            self.channel.group_store(self.generation),
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            backend=self.backend,
            device=self.device,
            timeout_s=self.collective_timeout_s,
        )

    def recover(self, failure: BaseException, log: Callable[[str], None]) -> None:
        """After a failed collective: read the decision, leave the broken group, join the next one. Raises
        RecoveryImpossible (with the reason) when the job must restart every rank instead."""
        stages = Stages(failed=time.time())
        try:
            self.channel.report_failure(self.generation, self.member)  # what the standbys wait for before they judge
        except RuntimeError as exc:
            raise RecoveryImpossible(f"the store at {store_address()} does not answer ({first_line(exc)}): {STORE_LOST}") from None
        decision = self._decision(failure)
        stages.decided = time.time()
        if decision.fallback is not None:
            raise RecoveryImpossible(decision.fallback)
        if decision.roster.get(self.rank) != self.member:
            self.counted_dead = True
            raise RecoveryImpossible(f"this rank ({self.member}) was counted dead by the standbys (its heartbeat stopped for {STALE_S:g}s)")
        lost = ", ".join(f"rank {r}" for r in sorted(decision.dead))
        taken = ", ".join(f"{s} takes rank {r}" for r, s in sorted(decision.replacements.items()))
        log(
            f"recovery: {lost} lost in generation {self.generation} ({type(failure).__name__}); {taken}; "
            f"forming generation {decision.generation} in this process (pid {os.getpid()})"
        )
        tear_down(self.backend)
        stages.torn_down = time.time()
        self.generation = decision.generation
        try:
            self.join()
        except (RuntimeError, ValueError) as exc:
            raise RecoveryImpossible(
                f"a failure while recovering: generation {self.generation}'s group did not form ({first_line(exc)})"
            ) from None
        stages.joined = time.time()
        self.stages = stages

    def _decision(self, failure: BaseException) -> Decision:
        deadline = time.monotonic() + DECISION_WAIT_S
        try:
            while (decision := self.channel.decision(self.generation, self.world_size)) is None:
                if time.monotonic() > deadline:
                    standbys = self.channel.standbys()
                    if not standbys:
                        raise RecoveryImpossible(
                            f"a collective failed ({first_line(failure)}) and no standby is running (start one with --standby)"
                        )
                    if dead := self._stopped(standbys):
                        raise RecoveryImpossible(
                            f"a collective failed ({first_line(failure)}) and the standby is dead ({', '.join(dead)}: heartbeat stopped)"
                        )
                    raise RecoveryImpossible(
                        f"a collective failed ({first_line(failure)}) but no standby saw a heartbeat stop within {DECISION_WAIT_S:g}s: "
                        "a hang, or a collective slower than its timeout"
                    )
                time.sleep(HEARTBEAT_S / 5)
            return decision
        except RecoveryImpossible:
            raise
        except RuntimeError as exc:
            raise RecoveryImpossible(f"the store at {store_address()} does not answer ({first_line(exc)}): {STORE_LOST}") from None

    def _stopped(self, members: list[str]) -> list[str]:
        """The members whose heartbeat count does not rise in STALE_S (the standbys watch; this is for when none did)."""
        before = self.channel.beats(members)
        time.sleep(STALE_S)
        after = self.channel.beats(members)
        return [m for m in members if (now := after[m]) is None or ((then := before[m]) is not None and now.count <= then.count)]

    def close(self, *, run_over: bool) -> None:
        """This rank's run ended. `run_over` (it finished, was stopped, or the job falls back to a restart): the
        standbys leave, said before the heartbeat stops, so that a rank that finished first is never taken for
        dead while rank 0 still evaluates. A rank that ends alone (counted dead, its own error) leaves the standbys
        watching: the others may still need one."""
        distributed.abandon_check = None
        if run_over and not self.counted_dead:
            with contextlib.suppress(RuntimeError):  # a store already gone has no standby left to tell
                self.channel.close()
        self.heartbeat.stop()


class Standby:
    """A warm process waiting to take a dead rank's place, watching every member's heartbeat meanwhile."""

    def __init__(
        self,
        *,
        world_size: int,
        host: str,
        log: Callable[[str], None],
        index: int | None = None,
        launched: int = 0,
        rank0_hosts_store: bool = True,
    ) -> None:
        """`index`: which of the launcher's `launched` standby tasks this is (None: started by hand, --standby);
        `rank0_hosts_store`: no store task serves the store (rank 0's death is then a fallback, `decide`)."""
        self.world_size, self.host, self.log = world_size, host, log
        self.rank0_hosts_store = rank0_hosts_store
        self.channel = Channel.of_job(_store(False), os.environ, log, launched=launched)
        self.member = self.channel.new_standby(index)
        self.heartbeat = Heartbeat(self.channel, self.member, host)
        self.generation = 0
        self.roster = {rank: f"r{rank}" for rank in range(world_size)}
        self._first: dict[str, float] = {}  # member -> when this standby first looked for it
        self._nodes: dict[str, tuple[NodeBeat, float]] = {}  # node -> (its newest value, when it came)
        self._on_node: dict[str, list[str]] = {}  # node -> the members located there
        self._located = (0, 0)  # (members located, the channel's moves) when _on_node was built
        self._waits: dict[str, tuple[int | None, float]] = {}  # survivor -> (highest waiting count, when it last rose)
        self.left: tuple[str, str] | None = None  # why `wait` ended without a rank: (a STANDBY_REASONS, a line)
        self._held: float | None = None  # since when a decision waits for a member half-way to STALE_S (`_watch`)

    def wait(self) -> tuple[int, int] | None:
        """Watch until this standby is given a rank: (generation, rank); None when it leaves without one (`left` says
        why: train/outcome.py's STANDBY_REASONS and a line)."""
        log = self.log
        log(f"standby {self.member} on {self.host}: warm, watching {self.world_size} ranks")
        failing_since: float | None = None
        while True:
            try:
                if self.channel.closed():
                    self.left = ("run-over", "the run ended without needing it")
                    return None
                decision = self.channel.decision(self.generation, self.world_size)
                if decision is not None:
                    if decision.fallback is not None:
                        log(f"standby {self.member}: the job falls back to a restart ({decision.fallback})")
                        self.left = ("fallback", f"the job falls back to a restart ({decision.fallback})")
                        return None
                    self.generation, self.roster = decision.generation, decision.roster
                    mine = [rank for rank, member in decision.replacements.items() if member == self.member]
                    if mine:
                        return self.generation, mine[0]
                    continue
                self._watch()
                failing_since = None
            except RuntimeError as exc:  # one slow answer is no reason to leave; a store gone for STORE_GONE_S is
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since >= STORE_GONE_S:
                    log(
                        f"standby {self.member}: the store at {store_address()} stopped answering ({first_line(exc)}): {STORE_LOST}; leaving"
                    )
                    self.left = (
                        "store-gone",
                        f"the job's store at {store_address()} stopped answering ({first_line(exc)}): {STORE_LOST}",
                    )
                    return None
                time.sleep(STORE_GONE_S / 4)  # a few tries, not one a heartbeat (torch logs each failed call)
            time.sleep(HEARTBEAT_S)

    def _survivor_waiting(self, survivors: list[str], now: float) -> bool:
        """Whether a survivor's waiting count (in its heartbeat) rose in the last FROZEN_S: it waits on a collective now."""
        alive = set(survivors)
        for value, _ in self._nodes.values():
            for member, beat in value.members.items():
                if member not in alive or beat.waiting is None or beat.waiting[0] != self.generation:
                    continue
                count, highest = beat.waiting[1], self._waits.get(member, (None, 0.0))[0]
                if highest is None or count > highest:
                    self._waits[member] = (count, now if highest is not None else now - FROZEN_S)  # the first sight is no rise
        return any(now - when < FROZEN_S for member, (_, when) in self._waits.items() if member in alive)

    def _silences(self, members: list[str], now: float) -> dict[str, float]:
        """How long each member that may be stale has not beaten: its age on its node when the node's value last came
        (measured on the node's own clock: train/node_beats.py) plus how long ago that value came; a member never seen
        counts from this standby's first look. A member whose node said, in a value younger than STALE_S, that its
        process runs (its beat late, the process neither stopped nor ended) is as silent as its node: alive, however
        late its own beat (a heartbeat thread held back on a saturated node is no frozen rank; a stopped or ended
        process, or a node whose values stopped, says nothing of the kind). One read and one head a node: a node whose
        oldest member is younger than STALE_S is not parsed further, and its members are not listed (they are not stale)."""
        for member in members:
            self._first.setdefault(member, now)
        where = self.channel.locate(members)
        for node, value in self.channel.node_beats(sorted(set(where.values()))).items():
            if value is not None and ((seen := self._nodes.get(node)) is None or value.at_ns > seen[0].at_ns):
                self._nodes[node] = (value, now)
                if len(where) < len(members):  # a member not located yet: the node values say where theirs beat
                    self.channel.learn(node, value)
        if len(where) < len(members):
            where = self.channel.locate([m for m in members if m not in where]) | where
        if (len(where), self.channel.moves) != self._located:
            self._on_node, self._located = {}, (len(where), self.channel.moves)
            for member, node in where.items():
                self._on_node.setdefault(node, []).append(member)
        silent = {m: now - self._first[m] for m in members if m not in where}
        for node, on in self._on_node.items():
            if (seen := self._nodes.get(node)) is None:
                silent.update((m, now - self._first[m]) for m in on)
            elif (since := now - seen[1]) + seen[0].oldest_ms / 1000 >= STALE_S:
                beats, fresh = seen[0].members, since < STALE_S
                for m in on:
                    beat = beats.get(m)
                    if beat is None:
                        silent[m] = now - self._first[m]
                    else:
                        silent[m] = since if fresh and beat.running else since + beat.age_ms / 1000
        return silent

    def _watch(self) -> None:
        """One look at every node's heartbeat; a roster member that has not beaten for STALE_S is dead once a survivor has
        reported its collective failed: decide, once for the generation. A member on a node the job lost (`fenced`: Slurm
        dropped it, the job program saw it) is dead at once, whatever it still does: it never joins a group again."""
        standbys = self.channel.standbys()
        members = [*self.roster.values(), *standbys]
        now = time.monotonic()
        silent = self._silences(members, now)
        stale = {m for m, seconds in silent.items() if seconds >= STALE_S}
        fenced = self.channel.fenced()
        out = {m for m, host in self._hosts().items() if host in fenced} if fenced else set()
        dead = {rank: m for rank, m in self.roster.items() if m in stale and m not in out}
        survivors = [m for m in self.roster.values() if m not in stale and m not in out]
        reported = True
        if dead and not (reported := self.channel.failure_reported(self.generation, survivors)):
            # No collective failed: a heartbeat late on a loaded node while every collective still completes is no
            # death. One stopped for FROZEN_S while a survivor waits on a collective is a frozen rank or a lost node.
            dead = {rank: m for rank, m in dead.items() if silent[m] >= FROZEN_S}
            if not self._survivor_waiting(survivors, now):
                dead = {}
        dead |= {rank: m for rank, m in self.roster.items() if m in out}
        if not dead:
            self._held = None
            return
        # A node lost goes silent member by member, each from its own last beat (its value names each one's age): a
        # member half-way to STALE_S on a dead one's node is waited for (at most STALE_S more), so that one decision
        # takes every rank of a lost node. Deciding for the first alone leaves the next in the new roster, and the new
        # group waits for it until JOIN_TIMEOUT_S (seen on the test cluster: a node set DOWN fell back so, 2 runs in 9).
        # Only node-mates: a late value from another, loaded node holds no decision back.
        gone = set(dead.values())
        mates = {m for on in self._on_node.values() if gone.intersection(on) for m in on}
        suspect = [m for m in survivors if m in mates and silent.get(m, 0.0) >= STALE_S / 2]
        if suspect:
            self._held = now if self._held is None else self._held
            if now - self._held < STALE_S:
                return
        self._held = None
        used = set(self.roster.values())
        alive = [s for s in standbys if s not in stale and s not in used and s not in out]
        decision = decide(self.generation, self.roster, dead, self._hosts(), alive, rank0_hosts_store=self.rank0_hosts_store)
        lost = ", ".join(f"rank {r}" for r in sorted(dead))
        how = "" if reported else f" for {FROZEN_S:g}s while a survivor waits on a collective (frozen, or its node lost)"
        if out & set(dead.values()):
            how = f" or its node left the job ({','.join(sorted(fenced))}: fenced)"
        self.log(f"standby {self.member}: heartbeat of {lost} stopped{how}; deciding generation {self.generation}")
        self.channel.write_decision(self.generation, decision, self.world_size)

    def _hosts(self) -> dict[str, str]:
        """Each located member's host, as its node's newest heartbeat names it."""
        return {m: self._nodes[node][0].host for node, on in self._on_node.items() if node in self._nodes for m in on}


class CollectiveClock:
    """Sets the process group's collective timeout from the measured steps (see `collective_timeout`)."""

    def __init__(self, ceiling_s: float) -> None:
        self.ceiling_s = ceiling_s
        self.slowest_s = 0.0
        self.timeout_s = ceiling_s
        self._to_measure = MEASURED_STEPS

    def relax(self) -> None:
        """A pause one rank takes alone is next (eval, a snapshot's copy) or a new group: the long timeout
        until MEASURED_STEPS more steps have been timed."""
        self._to_measure = MEASURED_STEPS
        self._set(self.ceiling_s)

    def measured(self, step_s: float) -> None:
        """`step_s`: one step's length, collectives included. The first after a relax is not counted: a new
        generation's first step rebuilds DDP's buckets, and a step after eval waited for rank 0's eval."""
        if self._to_measure > 0:
            self._to_measure -= 1
            if self._to_measure == MEASURED_STEPS - 1:
                return
        self.slowest_s = max(self.slowest_s, step_s)
        if self._to_measure == 0:
            wanted = collective_timeout(self.slowest_s, ceiling_s=self.ceiling_s)
            if wanted > self.timeout_s * 1.25 or wanted < self.timeout_s / 1.25:
                self._set(wanted)

    def _set(self, seconds: float) -> None:
        if seconds != self.timeout_s:
            set_collective_timeout(seconds)
            self.timeout_s = seconds


class Recovery:
    """--recovery as the trainer sees it, its one collaborator for it: the membership (store, heartbeat, generation),
    the collective clock, and the timeline of the recovery in progress. The trainer asks it to run a step (seeded
    from the position, timed for the clock), to relax the clock around a pause one rank takes alone, and to recover
    from a failed collective; it hands back the finished recovery's timeline once the first step after it is done."""

    def __init__(self, membership: Membership, ceiling_s: float) -> None:
        self.membership = membership
        self.clock = CollectiveClock(ceiling_s)
        self.replacing = membership.replacing  # a standby that took a dead rank's place: its state comes from the survivors
        self.hosts_changed: Callable[[list[str]], None] | None = None  # told the ranks' hosts after a recovery (the watchdog)

    @property
    def generation(self) -> int:
        return self.membership.generation

    def relax(self) -> None:
        """A pause one rank takes alone is next (eval, a snapshot's copy) or a new group (see CollectiveClock)."""
        self.clock.relax()

    def step(self, seed: int, rank: int, global_step: int, run: Callable[[], T]) -> T:
        """`run` (one optimizer step) with its RNG derived from its position, its length timed for the clock."""
        reseed(seed, rank, global_step)
        began = time.perf_counter()
        result = run()
        self.clock.measured(time.perf_counter() - began)
        return result

    def recover(self, failure: BaseException, log: Callable[[str], None]) -> None:
        """The next generation's group formed with the standbys in the dead ranks' places (RecoveryImpossible: the job
        restarts every rank instead)."""
        self.membership.recover(failure, log)

    def timeline(self) -> tuple[float, float, float, float] | None:
        """This survivor's stages of the recovery in progress, up to the new group (None: none, or a standby's)."""
        stages = self.membership.stages
        return None if stages is None else (stages.failed, stages.decided, stages.torn_down, stages.joined)

    def took_state(self, source_timeline: tuple[float, float, float, float] | None = None) -> None:
        """The state every rank now holds came from the survivors: this process replaces no one any more. A standby
        takes the state source's timeline (`timeline`) as its own: in rank 0's place, it writes the recovery's record."""
        self.replacing = False
        if self.membership.stages is None and source_timeline is not None:
            failed, decided, torn_down, joined = (float(t) for t in source_timeline)
            self.membership.stages = Stages(failed=failed, decided=decided, torn_down=torn_down, joined=joined)
        if self.membership.stages is not None:
            self.membership.stages.state = time.time()

    def finished(self) -> dict[str, float] | None:
        """The timeline of the recovery whose first step just finished (None when none was in progress)."""
        stages, self.membership.stages = self.membership.stages, None
        if stages is None:
            return None
        stages.first_step = time.time()
        return stages.fields()


def warm_up(device: torch.device, watcher: PreemptionWatcher) -> None:
    """What a standby does before it waits, so that taking a rank costs no first-time work: DDP's first
    construction imports and sets up ~2 s of torch (measured here: 2.1 s, against 0.01 s for the next one),
    so one is built and stepped on a one-process group of its own (a small stand-in module: the imports are
    the cost, not the model), and on CUDA the device's context is made. `watcher` is the process's own (a second one
    would take a SIGTERM that arrives meanwhile and lose it when it was put back)."""
    from train.grad_sync import SyncedModel  # the trainer's own; imported here, not at the top, to keep recovery.py light

    if device.type == "cuda":
        torch.empty(1, device=device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model: SyncedModel | None = None
    try:
        model = SyncedModel(
            torch.nn.Linear(2, 1),
            watcher=watcher,
            world_size=1,
            device=torch.device("cpu"),
            compress=False,
            compiled=None,
            find_unused_parameters=False,
        )
        model.zero_grads()
        model.backward(model(torch.ones(1, 2)).sum(), syncs=True)
        model.finish()
        dist.all_gather_object([None], "warm")
    finally:
        # DDP's reducer holds the group in a reference cycle: freed by a later garbage collection, its destructor joins
        # gloo's threads holding the interpreter's lock (0.3 s here, 27 s once on the test cluster), and a collection
        # that falls in the recovery this standby joins costs that recovery as much. Freed now, while it waits.
        model = None
        dist.destroy_process_group()
        gc.collect()


# Said once at the start of a CUDA job under --recovery (docs/recovery.md's limits).
NCCL_UNPROVEN = (
    "recovery: in-process recovery on NCCL has not run across two GPUs yet (one-GPU tests only): the check that a "
    "step's all-reduce completed before its optimizer runs is built but unproven there; the job falls back to a "
    "restart where recovery cannot form a group"
)


def launcher_role(standbys: int, environ: MutableMapping[str, str], store_task: bool = False) -> str:
    """What this process of the launcher's is: "rank", "standby" (one of the last `standbys` before the store task: a
    job template's extra tasks of the step, `--standbys K`, DDPACK_STANDBYS) or "store" (with `store_task`, the very
    last one: it serves the job's store, `serve_store`). The others train in a world of WORLD_SIZE - K (- 1), which is
    set in `environ`, so that whatever reads it next (the process group, the watchdog, the preflight's rules) sees the
    training world, as train.distributed reads it; a standby's RANK is set to the rank it takes."""
    extra = standbys + int(store_task)
    if extra <= 0:
        return "rank"
    rank, launched = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    world = launched - extra
    if world < 1:
        what = {(True, False): f"--standbys {standbys} leaves", (False, True): "the store task leaves"}.get(
            (standbys > 0, store_task), f"--standbys {standbys} and the store task leave"
        )
        raise RecoveryImpossible(f"{what} no rank to train: the launcher started {launched} process(es) (WORLD_SIZE={launched})")
    environ["WORLD_SIZE"] = str(world)
    if store_task and rank == launched - 1:
        return "store"
    return "standby" if rank >= world else "rank"


def store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


# Why a store that stopped answering ends recovery, in every line that says it.
STORE_LOST = "its host (the store task's process or node; rank 0 where the job has no store task) is lost"


def lost_nodes(path: Path, seen: tuple[object, frozenset[str]]) -> tuple[object, frozenset[str]]:
    """The nodes the job program wrote to `path` (train/run_folder.py LOST_NODES: one a line, the nodes Slurm dropped
    from the job during this step), with the file's change time and size; `seen` again while the file has not changed."""
    try:
        stat = path.stat()
        changed = (stat.st_mtime_ns, stat.st_size)  # two writes within one clock tick differ in size: the file only grows in a step
        if changed == seen[0]:
            return seen
        names = frozenset(line for line in path.read_text().split() if HOSTNAME.fullmatch(line))
    except (OSError, UnicodeDecodeError):
        return seen
    return changed, names


def serve_store(
    *,
    standbys: int,
    connect_s: float,
    log: Callable[[str], None],
    respawn: StandbyForker | None = None,
    lost_file: Path | None = None,
) -> int:
    """The store task (`--store-task`, DDPACK_STORE_TASK=1: the launcher's last process, which trains nothing): torch's
    own TCPStore served at MASTER_PORT on this node (MASTER_ADDR, the step's first node), in a process that is no rank,
    so that rank 0's death is recovered as any rank's: the ranks and standbys are all its clients, and the keys on it
    are signed as ever (train.recovery_channel). It serves until the run ends: the run's `closed` key, then up to
    STORE_LINGER_S while members still beat (the standbys read it and leave), or no member's heartbeat risen for
    STORE_IDLE_S (every member gone without closing). Slurm's stop signals (SIGTERM, SIGUSR1) do not end it: a
    preempted run's ranks close the run themselves, and srun kills what is left of the step.

    `respawn` (None where a standby would want a GPU the node's ranks hold; the caller closes it): each standby a
    recovery's decision consumed is replaced by a new one forked on this node (`StandbyForker.spawn`, at most
    MAX_RESPAWNED a run), so that a second and a third death are recovered too.

    `lost_file` (the run folder's LOST_NODES, which the job program writes when srun says a node failed: Slurm dropped it
    from the job, set DOWN): its nodes are fenced on the store (`Channel.fence`), so that their members, even ones still
    running and reaching the store, are counted dead by the standbys at once and never join a group again."""
    for stop in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop, signal.SIG_IGN)
    world = int(os.environ["WORLD_SIZE"])
    try:
        server = _store(True, connect_s)
    except (RuntimeError, ValueError) as exc:
        if respawn is not None:
            respawn.end_unused()
        log(f"store task: cannot serve the job's store at {store_address()} ({first_line(exc)})")
        return 1
    channel = Channel.of_job(server, os.environ, log, launched=standbys)
    log(
        f"store task on {node_name()}: serving the job's store at {store_address()} (pid {os.getpid()}) for {world} ranks and their standbys"
    )
    ranks = [f"r{rank}" for rank in range(world)]
    seen: dict[str, int] = {}
    last_rise, idle_s, closed_at = time.monotonic(), max(STORE_IDLE_S, connect_s), None
    generation, spawned = 0, 0
    lost: tuple[object, frozenset[str]] = (0, frozenset())
    while True:
        time.sleep(0.2)
        now = time.monotonic()
        if lost_file is not None and (found := lost_nodes(lost_file, lost)) != lost:
            with contextlib.suppress(RuntimeError):
                channel.fence(found[1])
                lost = found
                log(f"store task: {','.join(sorted(lost[1]))} left the job (set DOWN): fenced, its members are counted dead")
        try:
            beats = channel.beats([*ranks, *channel.standbys()])
            closed = closed_at is not None or channel.closed()
            decision = channel.decision(generation, world)
        except RuntimeError:  # its own server: never expected; a next look
            continue
        if decision is not None and decision.fallback is None:
            generation = decision.generation
            for _ in decision.replacements:
                if respawn is not None and spawned < MAX_RESPAWNED:
                    respawn.spawn(generation)
                    spawned += 1
        for member, beat in beats.items():
            if beat is not None and beat.count > seen.get(member, -1):
                seen[member], last_rise = beat.count, now
        if closed and closed_at is None:
            closed_at = now
        if closed_at is not None and (now - last_rise >= 2 * STALE_S or now - closed_at >= STORE_LINGER_S):
            log("store task: the run ended; the store closes")
            return 0
        if now - last_rise >= idle_s:
            log(f"store task: no member's heartbeat rose for {idle_s:g}s (every rank and standby gone); the store closes")
            return 0


def enter(
    *,
    standby: bool,
    backend: str,
    device: torch.device,
    collective_timeout_s: float,
    log: Callable[[str], None],
    watcher: PreemptionWatcher,
    standbys: int = 0,
    store_task: bool = False,
) -> tuple[DistContext, Membership] | None:
    """Join the job's process group under --recovery: a rank at once (generation 0), a standby once it is given a
    dead rank's place (None when the run ended without needing it). `standbys`: the launcher's last ranks that are
    standbys (`launcher_role`); `standby`: this process is one whatever its rank (started by hand, --standby);
    `store_task`: the launcher's last process serves the store (the caller has served it already: `store_role`)."""
    default_to_one_process()
    launched = launcher_role(standbys, os.environ, store_task) == "standby"
    standby = launched or standby
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    host = node_name()
    settings: dict[str, Any] = {"world_size": world, "backend": backend, "device": device, "collective_timeout_s": collective_timeout_s}
    if standby:
        # Every way a standby leaves without a rank ends in its record (StandbyEnd), which the job's program says.
        index = rank - world if launched else None
        name = f"s{index}" if index is not None else "standby"
        try:
            warm_up(device, watcher)
        except Exception as exc:  # an import, the device: this standby cannot start, the run goes on without it
            log(StandbyEnd(name, host, "cannot-start", f"its warm-up failed ({type(exc).__name__}: {first_line(exc)})").line())
            return None
        try:
            waiting = Standby(world_size=world, host=host, log=log, index=index, launched=standbys, rank0_hosts_store=not store_task)
        except RuntimeError as exc:  # a run shorter than this standby's warm-up has ended, and its store with it
            log(f"standby: the job's store does not answer ({first_line(exc)}): the run ended before this standby was warm; leaving")
            log(StandbyEnd(name, host, "store-gone", f"the job's store does not answer ({first_line(exc)})").line())
            return None
        except RecoveryImpossible as exc:  # its heartbeat cannot be written on this node
            log(StandbyEnd(name, host, "cannot-start", str(exc)).line())
            return None
        assigned = waiting.wait()
        if assigned is None:
            waiting.heartbeat.stop()
            log(StandbyEnd(waiting.member, host, *(waiting.left or ("run-over", "its wait ended"))).line())
            return None
        generation, rank = assigned
        os.environ["RANK"] = str(rank)  # the rank it is now, for whatever reads the environment after this
        membership = Membership(
            channel=waiting.channel, heartbeat=waiting.heartbeat, member=waiting.member, rank=rank, generation=generation, **settings
        )
    else:
        log = RankLog(rank, world)  # the trainer's own lines, before the trainer has one
        membership = Membership.started(rank=rank, host=host, log=log, launched=standbys, store_task=store_task, **settings)
        if backend == "nccl":
            log(NCCL_UNPROVEN, main_only=True)
    membership.join()
    ctx = DistContext(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, backend=backend, device=device, host=host
    )
    return ctx, membership
