"""In-process recovery's control channel: its keys in the job's rendezvous store, every value signed, every read checked.

The store answers anyone who reaches its port (torch's TCPStore has no authentication), and on a shared cluster that
is every other user: with a port computable from the job id, one `set` of an unsigned decision used to make every
rank give up, a deleted heartbeat to send the standbys away. So under the job's token (DDPACK_JOB_TOKEN, which the
templates set and only the job's processes have; train.job_keys):
- the keys lie under a prefix derived from the token and the job's start (another start's values never verify here);
- every value this channel acts on is signed over its whole key, and read back only through `Signer.open` and a
  parser of its shape: a value that does not verify or parse is ignored with one line (once per key and reason),
  never acted on, never a traceback;
- the counters that `add` keeps (the standbys' indexes, a generation's failure count) are hints that cost a read,
  never facts: a standby is one that registered a signed node (or that a node's signed heartbeat names), a failure is
  a signed report of a member's own;
- a key that is missing (deleted by someone else) is "no news", never an error: a heartbeat read with `check`
  first, so that a deletion cannot make `multi_get` wait out the store's timeout and take the reader down with it.

Heartbeats are one key a node, not one a member (train/node_beats.py): `hb/<node>` holds every member's count there,
written by the node's two writers; `at/<member>` (a member's signed registration) says which node a member beats on, so
that a standby reads one key a node every HEARTBEAT_S.

What another user can still do is deny service: delete the process group's own keys, flood the port, bump a counter
so the readers check more keys. She cannot make a member act on anything she wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from entrypoint.plan import job_token
from train.job_keys import HOSTNAME, BadValue, Signer, store_prefix
from train.node_beats import MEMBER, NODE_ID

T = TypeVar("T")
NAME = "ddpack-recovery"
MAX_STANDBYS = 4096  # indexes past this are not read: a counter another user bumped costs the readers nothing more
MAX_DECISION_BYTES = 1 << 20  # a roster of 8,192 ranks is ~150 KB
MAX_REASON = 1000


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What a generation's failure leads to, written once by the first standby to see it."""

    generation: int  # the next generation's number
    roster: dict[int, str]  # rank -> member, in the next generation
    dead: dict[int, str]  # rank -> member that died
    replacements: dict[int, str] = field(default_factory=dict)  # rank -> standby taking it
    fallback: str | None = None  # why recovery cannot work; then the job restarts every rank

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def parse(cls, text: str, *, generation: int, world_size: int) -> Decision:
        """The decision that leads to `generation`, checked field by field against what a standby of this job
        writes (BadValue otherwise): a roster of exactly the world's ranks, members by name, replacements that are
        standbys of the roster, a one-line reason."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise BadValue(f"not JSON ({type(exc).__name__})") from None
        if not isinstance(data, dict) or set(data) != {"generation", "roster", "dead", "replacements", "fallback"}:
            raise BadValue(f"fields {sorted(data)[:8] if isinstance(data, dict) else type(data).__name__}; expected a decision's")
        if data["generation"] != generation or type(data["generation"]) is not int:
            raise BadValue(f"generation {str(data['generation'])[:20]!r}; expected {generation}")
        roster, dead, replacements = (_ranks(data[name], name, world_size) for name in ("roster", "dead", "replacements"))
        if set(roster) != set(range(world_size)):
            raise BadValue(f"a roster of ranks {sorted(roster)[:8]}; expected 0..{world_size - 1}")
        if any(roster[rank] != member or not member.startswith("s") for rank, member in replacements.items()):
            raise BadValue("a replacement that is not the roster's standby for its rank")
        fallback = data["fallback"]
        if fallback is not None and not (isinstance(fallback, str) and len(fallback) <= MAX_REASON and "\n" not in fallback):
            raise BadValue("a fallback that is not one line of text")
        return cls(generation=generation, roster=roster, dead=dead, replacements=replacements, fallback=fallback)


def _ranks(value: Any, name: str, world_size: int) -> dict[int, str]:
    """A {rank: member} map of the decision (JSON keys are strings)."""
    if not isinstance(value, dict):
        raise BadValue(f"{name} is not an object")
    out: dict[int, str] = {}
    for key, member in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < world_size):
            raise BadValue(f"{name} names rank {str(key)[:20]!r}; expected 0..{world_size - 1}")
        if not (isinstance(member, str) and MEMBER.fullmatch(member)):
            raise BadValue(f"{name} names member {str(member)[:20]!r}; expected r<rank> or s<n>")
        out[int(key)] = member
    return out


class Beat(NamedTuple):
    """One member's heartbeat as its node's value says it: a count that rises with each of its beats, its node's host,
    how old its last beat was when the value was written (ms, on the node's own clock), the collective it waits on,
    if any: (generation, a count that rises while it waits), and whether the node saw its process run then, its beat
    late (`running`: train/node_beats.py's LocalBeat.runs; said only of a late beat). A tuple: cheap to make by the
    thousand."""

    count: int
    host: str
    age_ms: int = 0
    waiting: tuple[int, int] | None = None
    running: bool = False


NODE_ENTRY = r"[rs][0-9]{1,7}:[0-9]{1,18}:[0-9]{1,9}(?::[0-9]{1,9}:[0-9]{1,18})?\+?"
NODE_ENTRIES = re.compile(rf"(?:{NODE_ENTRY})(?: {NODE_ENTRY})*")  # the shape of a node's entries, checked at once
ENTRY_PARTS = re.compile(r"([rs][0-9]+):([0-9]+):([0-9]+)(?::([0-9]+):([0-9]+))?(\+?)")
MAX_NODE_MEMBERS = 4096
MAX_NODE_BYTES = 128 << 10
MAX_AGE_MS = 999_999_999


@dataclass(frozen=True)
class NodeBeat:
    """One node's heartbeat (train/node_beats.py), written by the node's writers every HEARTBEAT_S, re-said in full each
    time (a value another user damaged is mended 50 ms later): its host, when it was written (`at_ns`, the node's
    monotonic clock: it rises with every value of the node, whichever writer wrote it), the oldest member's age then,
    and every member's entry. Text: `host at_ns oldest_ms member:count:age_ms[:generation:waiting][+] ...` (`+`: running). A standby
    reads the head of every node's value each beat and the entries only of a node with an old member: one member's
    Python a node, not one a member, at 1,024 nodes x 8."""

    host: str
    at_ns: int
    oldest_ms: int
    entries: str = ""

    @classmethod
    def of(cls, host: str, at_ns: int, beats: Mapping[str, Beat]) -> NodeBeat:
        entries = " ".join(
            f"{m}:{b.count}:{min(b.age_ms, MAX_AGE_MS)}" + (f":{b.waiting[0]}:{b.waiting[1]}" if b.waiting else "") + "+" * b.running
            for m, b in sorted(beats.items())
        )
        return cls(host, at_ns, min(max((b.age_ms for b in beats.values()), default=0), MAX_AGE_MS), entries)

    def text(self) -> str:
        return f"{self.host} {self.at_ns} {self.oldest_ms} {self.entries}"

    @classmethod
    def parse(cls, text: str) -> NodeBeat:
        parts = text.split(" ", 3)
        if len(parts) != 4 or not HOSTNAME.fullmatch(parts[0]):
            raise BadValue(f"a node heartbeat {text[:40]!r}; expected a host, a time, an age and members")
        host, at_ns, oldest_ms, entries = parts
        if not (at_ns.isdigit() and len(at_ns) <= 20 and oldest_ms.isdigit() and len(oldest_ms) <= 9):
            raise BadValue(f"a node heartbeat's time and age {at_ns[:24]!r} {oldest_ms[:12]!r}; expected counts")
        if entries and not NODE_ENTRIES.fullmatch(entries):
            raise BadValue(f"a node heartbeat's entries {entries[:40]!r}; expected member:count:age[:generation:waiting] ...")
        if entries.count(" ") >= MAX_NODE_MEMBERS:
            raise BadValue(f"a node heartbeat of {entries.count(' ') + 1} members; expected at most {MAX_NODE_MEMBERS}")
        return cls(host, int(at_ns), int(oldest_ms), entries)

    @cached_property
    def members(self) -> dict[str, Beat]:
        """Every member's entry (parsed when asked: a node whose members are all young is never parsed)."""
        return {
            m: Beat(int(count), self.host, int(age), (int(generation), int(waited)) if generation else None, running == "+")
            for m, count, age, generation, waited, running in ENTRY_PARTS.findall(self.entries)
        }


def _node_id(text: str) -> str:
    if not NODE_ID.fullmatch(text):
        raise BadValue(f"a member's node {text[:20]!r}; expected 16 hex digits")
    return text


def _hosts(text: str) -> frozenset[str]:
    names = text.split(",") if text else []
    if len(names) > 1024 or not all(HOSTNAME.fullmatch(name) for name in names):
        raise BadValue(f"{text[:40]!r}; expected node names separated by commas")
    return frozenset(names)


def _marker(text: str) -> bool:
    if text != "1":
        raise BadValue(f"{text[:20]!r}; expected '1'")
    return True


class Channel:
    """Recovery's keys in the job's store (see the module's docstring). One per store client: a heartbeat thread
    has its own client and its own channel, on the same keys."""

    def __init__(self, store: dist.Store, *, prefix: str, signer: Signer, log: Callable[[str], None], launched: int = 0) -> None:
        self.store, self.prefix, self.signer, self.log = store, prefix, signer, log
        self.launched = launched  # the launcher's standbys (DDPACK_STANDBYS): s0..s<launched-1>, named by their task
        self._said: set[tuple[str, str]] = set()  # (key, reason) already logged: one line each, not one a poll
        self._standbys: set[int] = set()  # indexes known to have registered a signed node
        self._node_of: dict[str, str] = {}  # member -> its node's id, once known
        self.moves = 0  # how many times a known member's node changed (its node's directory made anew)

    @classmethod
    def of_job(cls, store: dist.Store, environ: Mapping[str, str], log: Callable[[str], None], launched: int = 0) -> Channel:
        """The channel of this job's start: prefix and signature from DDPACK_JOB_TOKEN (unsigned without one);
        `launched`: the standbys the launcher started as the last tasks of the step."""
        token = job_token(environ)
        return cls(store, prefix=store_prefix(NAME, environ, token), signer=Signer(token), log=log, launched=launched)

    def sibling(self, store: dist.Store) -> Channel:
        """The same keys on another client of the store (the heartbeat thread's)."""
        return Channel(store, prefix=self.prefix, signer=self.signer, log=self.log, launched=self.launched)

    # -------------------------------------------------------------- the keys, each spelled once

    @staticmethod
    def node_key(node: str) -> str:
        """A node's heartbeat (NodeBeat): every member's count there."""
        return f"hb/{node}"

    @staticmethod
    def member_key(member: str) -> str:
        """Which node a member beats on (its node's id): how a standby finds the node's key."""
        return f"at/{member}"

    @staticmethod
    def generation_key(generation: int, name: str) -> str:
        return f"gen{generation}/{name}"

    STANDBYS = "standbys"  # an `add` counter: a standby started by hand takes the next index past the launcher's
    CLOSED = "closed"  # the run ended: the standbys leave
    FENCED = "fenced"  # the nodes Slurm dropped from the job (set DOWN): their members are dead whatever they still do

    # -------------------------------------------------------------- writing and reading

    def put(self, key: str, value: str) -> None:
        full = self.prefix + key
        self.store.set(full, self.signer.seal(full, value))

    def read(self, key: str, parse: Callable[[str], T], max_bytes: int = 4096) -> T | None:
        """The value under `key` as `parse` makes it; None when there is none, or it does not verify or parse
        (said in one line, once per key and reason). Store errors (RuntimeError) are the caller's."""
        full = self.prefix + key
        if not self.store.check([full]):
            return None
        try:
            raw = self.store.get(full)
        except dist.DistStoreError:  # deleted between the check and the get: the get waited out the timeout
            return None
        return self._opened(key, raw, parse, max_bytes)

    def _fetched(self, keys: list[str]) -> dict[str, bytes]:
        """The values of those of `keys` that are there (a missing one is looked for key by key, never waited on)."""
        if not keys:
            return {}
        present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
        try:
            return dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        except dist.DistStoreError:  # one deleted between the check and the read: fetch the rest one by one
            return {k: self.store.get(k) for k in present if self.store.check([k])}

    def _opened(self, key: str, raw: bytes, parse: Callable[[str], T], max_bytes: int = 4096) -> T | None:
        try:
            return parse(self.signer.open(self.prefix + key, raw, max_bytes))
        except BadValue as exc:
            self.ignored(key, str(exc))
            return None

    def ignored(self, key: str, why: str) -> None:
        if (key, why) not in self._said:
            self._said.add((key, why))
            self.log(f"recovery: ignored the store's {key!r}: {why} (not written by this job's processes: another user's, or damaged)")

    # -------------------------------------------------------------- members

    def register(self, member: str, node: str) -> None:
        """`member` beats on node `node` (written when it starts; the node's writers say it again every REGISTER_S, so
        that a deleted registration is mended for a standby that starts later)."""
        self.put(self.member_key(member), node)

    def beat_node(self, node: str, beat: NodeBeat) -> None:
        self.put(self.node_key(node), beat.text())

    def node_beats(self, nodes: Sequence[str]) -> dict[str, NodeBeat | None]:
        """Each node's last signed heartbeat (None: none there, or one that does not verify or parse)."""
        keys = [self.prefix + self.node_key(n) for n in nodes]
        raw = self._fetched(keys)
        return {
            n: self._opened(self.node_key(n), raw[k], NodeBeat.parse, MAX_NODE_BYTES) if k in raw else None
            for n, k in zip(nodes, keys, strict=True)
        }

    def locate(self, members: Sequence[str]) -> dict[str, str]:
        """The node of each of `members` that is known: from a node value that named it (`learn`), else from its signed
        registration (read until found; a missing one is no news and never waited on)."""
        unknown = [m for m in members if m not in self._node_of]
        keys = [self.prefix + self.member_key(m) for m in unknown]
        raw = self._fetched(keys)
        for m, k in zip(unknown, keys, strict=True):
            if k in raw and (node := self._opened(self.member_key(m), raw[k], _node_id, 512)) is not None:
                self._node_of[m] = node
        return {m: node for m in members if (node := self._node_of.get(m)) is not None}

    def learn(self, node: str, beat: NodeBeat) -> None:
        """Where the members `beat` names beat: the job's own word (signed), so a registration another user deleted
        before it was read is not needed."""
        for m in beat.members:
            if self._node_of.setdefault(m, node) != node:
                self._node_of[m], self.moves = node, self.moves + 1

    def beats(self, members: Sequence[str]) -> dict[str, Beat | None]:
        """Each member's last beat, as its node's signed heartbeat says it (None: not seen). One read of each node's
        key, not one of each member's: the traffic grows with nodes."""
        nodes = sorted(set(self.locate(members).values()))
        found: dict[str, Beat] = {}
        for node, beat in self.node_beats(nodes).items():
            if beat is None:
                continue
            self.learn(node, beat)
            for m, seen in beat.members.items():
                if (mine := found.get(m)) is None or seen.count > mine.count:
                    found[m] = seen
        return {m: found.get(m) for m in members}

    def new_standby(self, index: int | None = None) -> str:
        """A standby's name, s<index>: the launcher's `index`-th standby task's, or (started by hand) the next index past
        the launcher's from the counter. It counts as a standby once its signed registration is there (`standbys`)."""
        if index is not None:
            return f"s{index}"
        return f"s{self.launched + int(self.store.add(self.prefix + self.STANDBYS, 1)) - 1}"

    def standbys(self) -> list[str]:
        """The standbys that have registered a signed node (as they start to beat), oldest first. The launcher's are
        looked for by name, so a counter another user bumped cannot hide them; the counter says only where to look for
        standbys by hand."""
        count = self.launched + min(int(self.store.add(self.prefix + self.STANDBYS, 0)), MAX_STANDBYS)
        unknown = [f"s{index}" for index in range(count) if index not in self._standbys]
        keys = [self.prefix + self.member_key(m) for m in unknown]
        for member, raw in self._fetched(keys).items():
            name = member[len(self.prefix + self.member_key("")) :]
            if self._opened(self.member_key(name), raw, _node_id, 512) is not None:
                self._standbys.add(int(name[1:]))
        # One named in a node's signed heartbeat is one too, its registration deleted or not (`beats`).
        self._standbys |= {int(m[1:]) for m in self._node_of if m.startswith("s")}
        return [f"s{index}" for index in sorted(self._standbys) if index < count]

    # -------------------------------------------------------------- a generation's failure and its decision

    def report_failure(self, generation: int, member: str) -> None:
        """`member`'s collective failed in `generation`: what the standbys wait for before they judge a stale
        heartbeat a death (a signed report of its own; the counter beside it only says one may be there)."""
        self.put(self.generation_key(generation, f"failed/{member}"), "1")
        self.store.add(self.prefix + self.generation_key(generation, "failed"), 1)

    def failure_reported(self, generation: int, members: Sequence[str]) -> bool:
        if not int(self.store.add(self.prefix + self.generation_key(generation, "failed"), 0)):
            return False
        return any(self.read(self.generation_key(generation, f"failed/{m}"), _marker) for m in members)

    def decision(self, generation: int, world_size: int) -> Decision | None:
        """Generation `generation`'s decision, when one of this job's standbys wrote it."""
        return self.read(
            self.generation_key(generation, "decision"),
            lambda text: Decision.parse(text, generation=generation + 1, world_size=world_size),
            MAX_DECISION_BYTES,
        )

    def decided(self, generation: int, world_size: int) -> bool:
        """Whether generation `generation` has a decision (one store round trip while there is no value at all)."""
        if not self.store.check([self.prefix + self.generation_key(generation, "decision")]):
            return False
        return self.decision(generation, world_size) is not None

    def write_decision(self, generation: int, decision: Decision, world_size: int) -> None:
        """Write `decision` unless one of this job's standbys wrote one first (compare-and-set: one decision a
        generation). A value there that does not verify is replaced, not deferred to: otherwise one forged `set`
        before the real decision would keep every member from ever reading one."""
        full = self.prefix + self.generation_key(generation, "decision")
        sealed = self.signer.seal(full, decision.to_json())
        expected = ""
        for _ in range(8):  # each turn replaces what another user wrote since the last; she cannot win for long
            now = self.store.compare_set(full, expected, sealed)
            if bytes(now).decode(errors="replace") == sealed or self._opened(
                self.generation_key(generation, "decision"),
                now,
                lambda text: Decision.parse(text, generation=generation + 1, world_size=world_size),
                MAX_DECISION_BYTES,
            ):
                return
            # What is there now is what to replace; when the key went missing (deleted since), compare_set hands back the
            # expected value without writing, and the next turn writes over nothing.
            expected = "" if bytes(now).decode(errors="surrogateescape") == expected else bytes(now).decode(errors="surrogateescape")

    def close(self) -> None:
        self.put(self.CLOSED, "1")

    def fence(self, nodes: frozenset[str]) -> None:
        """Every node in `nodes` is out of the job (the store task passes on what the job program saw: Slurm dropped
        it): its members, live or not, are never in a decision's roster again (`Standby._watch`)."""
        self.put(self.FENCED, ",".join(sorted(nodes)))

    def fenced(self) -> frozenset[str]:
        return self.read(self.FENCED, _hosts, max_bytes=65536) or frozenset()

    def closed(self) -> bool:
        return bool(self.read(self.CLOSED, _marker))

    def group_store(self, generation: int) -> dist.Store:
        """Where generation `generation`'s process group forms (torch's own rendezvous keys, under the job's prefix)."""
        return dist.PrefixStore(self.prefix + self.generation_key(generation, "pg/"), self.store)
