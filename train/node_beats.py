"""In-process recovery's heartbeats on one node: each member says it lives in a file of the node, two say it for all.

At 1,024 nodes x 8 ranks, one signed store write per member every HEARTBEAT_S is 164k writes a second, half the
store's capacity, and the standbys fell behind reading them (issue 62, point 6). So a member's own beat stays on its
node: a file in a directory private to the job's members there (named from the job's token and start, mode 0700, the
user's own), rewritten every beat (temp file then rename: a reader sees the whole line or the last one). The two
lowest members whose beats are fresh (within TAKEOVER_S) are the node's writers: each reads every member's file and
writes one signed store value for the node (train/recovery_channel.py's NodeBeat), so the store's traffic grows with
nodes. Two, not one: when a writer dies (a SIGKILLed rank is as likely a writer as any), the other's values go on
while a third takes its place, and no live node-mate's count stands still long enough to look dead.

A member's count in the node's value rises only while the member itself beats: a dead or frozen member's file stays
with its last count (the standbys see it stop, as they saw its key stop before); a lost node's writers go with it.
A member's beat also names its process (pid and start time), so the writers can say of a member whose beat is late
whether its process still runs on the node (`LocalBeat.runs`: there, neither stopped nor ended). A heartbeat thread
can be held back while its process lives (the interpreter's lock held by a long call, the node's cores saturated: seen
on the test cluster, a live rank's beat 1.5 s late while a standby warmed beside it); a stopped (SIGSTOP, a debugger)
or ended process cannot say it runs, and neither can a lost node. Where the pid is not this node's to read (members
of one directory in separate pid namespaces), the start time does not match and nothing is claimed.
Members of one host that do not share the directory (separate containers, separate /tmp) each have their own, and
their own node value: correct, only not fewer writes. Standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from train.job_keys import store_scope

MEMBER = re.compile(r"[rs][0-9]{1,7}")  # r<rank> for the ranks a job started with, s<n> for standbys (recovery_channel's too)
NODE_ID = re.compile(r"[0-9a-f]{16}")
WRITERS = 2  # members that write the node's value: one may die, the other's values go on meanwhile
# A member whose own beat is older than this is not a writer: a dead or frozen writer is replaced within it. Generous: a
# live member taken for late only makes a third writer for a while, which costs one more write, never a false death.
TAKEOVER_S = 0.15
STOPPED_OR_ENDED = "TtZXx"  # /proc/PID/stat's states of a process that does not run: stopped, traced, zombie, dead


def process_state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and start time (clock ticks since boot) from /proc, or None where there is none to read
    (ended and reaped, or not in this pid namespace)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command's name, which may hold spaces and parentheses
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19])


def this_process() -> tuple[int, int]:
    """This process's pid and start time, as its node-mates read them back from /proc (`LocalBeat.runs`)."""
    state = process_state(os.getpid())
    return os.getpid(), state[1] if state is not None else 0


@dataclass(frozen=True)
class LocalBeat:
    """One member's beat on its node: its rising count, when it wrote it (CLOCK_MONOTONIC, one clock for every process
    of the node), the collective it waits on, if any: (generation, a count that rises while it waits), and its process:
    pid and start time (0 0 where unknown)."""

    count: int
    at_ns: int
    waiting: tuple[int, int] | None = None
    pid: int = 0
    started: int = 0

    def text(self) -> str:
        waiting = f"{self.waiting[0]} {self.waiting[1]}" if self.waiting else "- -"
        return f"{self.count} {self.at_ns} {waiting} {self.pid} {self.started}"

    @classmethod
    def parse(cls, text: str) -> LocalBeat | None:
        parts = text.split()
        if len(parts) != 6 or not all(p.isdigit() for p in (*parts[:2], *parts[4:])):
            return None
        count, at_ns, pid, started = int(parts[0]), int(parts[1]), int(parts[4]), int(parts[5])
        if parts[2:4] == ["-", "-"]:
            return cls(count, at_ns, None, pid, started)
        if not all(p.isdigit() for p in parts[2:4]):
            return None
        return cls(count, at_ns, (int(parts[2]), int(parts[3])), pid, started)

    def runs(self) -> bool:
        """Whether the member's process still runs on this node: there, the one that wrote the beat (its start time),
        and neither stopped (SIGSTOP, a debugger) nor ended. A process waiting on the disk or the interpreter's lock
        runs; one this node cannot see (another pid namespace) is not claimed to."""
        state = process_state(self.pid) if self.pid else None
        return state is not None and state[1] == self.started and state[0] not in STOPPED_OR_ENDED


def member_order(member: str) -> tuple[str, int]:
    """Ranks before standbys, each by number: every member of the node picks the same writers."""
    return member[0], int(member[1:])


def directory_name(environ: Mapping[str, str], token: str | None) -> str:
    """The node directory's name for this job's start: from the start and the store's address (two jobs of one user on
    one node, or two starts of one job, never share one), keyed with the token where there is one (another user cannot
    name it in advance); without one (one user's machine), with the user's id."""
    start = f"{store_scope(environ)} {environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}".encode()
    if token is None:
        return f"ddpack-beats-{os.getuid()}-" + hashlib.sha256(b"ddpack-recovery node beats " + start).hexdigest()[:20]
    return "ddpack-beats-" + hmac.new(token.encode(), b"ddpack-recovery node beats " + start, hashlib.sha256).hexdigest()[:20]


def _private(path: Path) -> bool:
    """A directory of this user's that nobody else can write in (not a link someone left there)."""
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return False


class LocalBeats:
    """The job's directory on this node: every member's beat file, and the node's id (its store key's name)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.node = self._node_id()

    @classmethod
    def open(cls, environ: Mapping[str, str], token: str | None, root: Path | None = None) -> LocalBeats:
        """The job's directory under `root` (the temp directory: TMPDIR). One that exists but is not private to this user
        (someone else's, or open to others) is not used: this member gets a private directory of its own instead, and
        so a node value of its own."""
        root = root or Path(tempfile.gettempdir())
        path = root / directory_name(environ, token)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        if not _private(path):
            path = Path(tempfile.mkdtemp(prefix="ddpack-beats-own-", dir=root))
        return cls(path)

    def _node_id(self) -> str:
        """The id every member of this directory reads: the first to write it wins (a link fails where one exists)."""
        target = self.path / "id"
        while True:
            with contextlib.suppress(FileNotFoundError):
                text = target.read_text()
                if NODE_ID.fullmatch(text):
                    return text
                target.unlink()  # damaged (only the user's own processes can write here): made again
            mine = self.path / f".id.{os.getpid()}.{secrets.token_hex(4)}"
            mine.write_text(secrets.token_hex(8))
            try:
                os.link(mine, target)
            except FileExistsError:
                pass
            finally:
                mine.unlink()

    def write(self, member: str, beat: LocalBeat) -> None:
        """`member`'s beat, whole (temp file then rename)."""
        temp = self.path / f".{member}.{os.getpid()}"
        temp.write_text(beat.text())
        os.replace(temp, self.path / member)

    def read(self) -> dict[str, LocalBeat]:
        """Every member's last beat on this node (a file that does not parse is skipped: it is rewritten next beat)."""
        beats: dict[str, LocalBeat] = {}
        for name in os.listdir(self.path):
            if MEMBER.fullmatch(name):
                with contextlib.suppress(OSError):
                    if (beat := LocalBeat.parse((self.path / name).read_text())) is not None:
                        beats[name] = beat
        return beats

    @staticmethod
    def writers(beats: Mapping[str, LocalBeat], now_ns: int | None = None) -> list[str]:
        """The node's writers: the WRITERS lowest members whose beat is fresh."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        fresh = [m for m, beat in beats.items() if now_ns - beat.at_ns < TAKEOVER_S * 1e9]
        return sorted(fresh, key=member_order)[:WRITERS]

    def leave(self, member: str) -> None:
        """`member` stops beating: its file goes; the last member out (every other file stale) takes the directory with it."""
        with contextlib.suppress(OSError):
            (self.path / member).unlink(missing_ok=True)
            if self.writers(self.read()):
                return
            for name in os.listdir(self.path):
                (self.path / name).unlink(missing_ok=True)  # another leaver may have taken it first
            self.path.rmdir()
