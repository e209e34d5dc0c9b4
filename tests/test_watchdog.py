"""The hang watchdog's parts in one process: its default and bad settings, who it names, that it fires on a
stall and not while a peer is legitimately busy (a snapshot write, eval), and that what it reads from the store
is checked (tests/test_watchdog_store.py: a real store, another user, the job's token)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from train.config import parse_config
from train.job_keys import BadValue
from train.watchdog import EXIT_HANG, MISSES_FOR_GONE, GuardedStore, Heartbeat, Progress, Watchdog, judge


def test_the_default_is_three_minutes_or_below_a_shorter_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPACK_HANG_TIMEOUT", raising=False)
    assert parse_config([]).hang_timeout == 180
    assert parse_config(["--collective-timeout", "100"]).hang_timeout == 60
    assert parse_config(["--hang-timeout", "0"]).hang_timeout == 0
    monkeypatch.setenv("DDPACK_HANG_TIMEOUT", "42")
    assert parse_config([]).hang_timeout == 42


def test_a_hang_timeout_the_collective_timeout_would_beat_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--hang-timeout", "300"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "--hang-timeout 300 is not below --collective-timeout 300" in err


def beat(rank: int, sent: float, step: int, phase: str, stalled: float = 0.0) -> Heartbeat:
    return Heartbeat(rank=rank, host=f"node{rank}", pid=100 + rank, sent=sent, step=step, phase=phase, phase_s=1.0, stalled_s=stalled)


def test_judge_names_stale_ranks_then_the_earliest_live_position() -> None:
    now = 1000.0
    beats = {0: beat(0, now, 12, "sync"), 1: beat(1, now, 12, "data"), 2: beat(2, now - 30, 11, "forward")}
    verdict = judge(beats, 4, now, stale_after=5, timeout_s=10)
    assert verdict.summary["behind_ranks"] == [3, 2, 1]
    assert verdict.behind[1].startswith("rank 2 on node2 (pid 102): no heartbeat for 30s")
    assert verdict.behind[2] == "rank 1 on node1 (pid 101): in data after step 12 for 1s"
    # Every live rank at the same place: nobody is singled out (a collective they all wait in).
    assert judge({0: beat(0, now, 3, "sync"), 1: beat(1, now, 3, "sync")}, 2, now, 5, 10).behind == []


class DictStore:
    """The three calls the watchdog makes of a TCPStore."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def watchdog(rank: int, progress: Progress, store: DictStore, folder: Path, exits: list[int]) -> Watchdog:
    return Watchdog(
        progress, rank=rank, world_size=2, host=f"node{rank}", timeout_s=1.0, forensics_dir=folder,
        log=lambda line: None, store=GuardedStore(lambda: store, 2.0, prefix="t/"), exit=exits.append,
    )


def stalled(step: int, phase: str) -> Progress:
    progress = Progress()
    progress.step_done(step)
    progress.enter(phase)
    return progress


def test_a_stall_on_every_rank_ends_both_with_their_stacks_and_one_summary(tmp_path: Path) -> None:
    store, exits = DictStore(), []
    dogs = [watchdog(0, stalled(7, "sync"), store, tmp_path, exits), watchdog(1, stalled(7, "data"), store, tmp_path, exits)]
    for dog in dogs:
        dog.start()
    deadline = time.monotonic() + 30
    while len(exits) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [EXIT_HANG, EXIT_HANG]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["behind_ranks"] == [1] and summary["written_by"] == 0 and set(summary["stacks"]) == {"0", "1"}
    assert (tmp_path / "rank-1.txt").read_text().startswith("rank 1/2 host node1 pid ")
    assert "--- thread MainThread" in (tmp_path / "rank-0.txt").read_text()


def test_no_hang_while_a_peer_writes_a_snapshot_or_before_the_first_step(tmp_path: Path) -> None:
    """Rank 1 waits in the next collective for 3x the timeout while rank 0 writes a snapshot (fresh
    heartbeats, untimed phase); a rank that has not finished its first step is not timed at all."""
    store, exits = DictStore(), []
    writer = Progress()
    writer.step_done(7)
    writer.enter_counted("snapshot")
    dogs = [watchdog(0, writer, store, tmp_path, exits), watchdog(1, stalled(7, "sync"), store, tmp_path / "r1", exits)]
    first = watchdog(0, Progress(), DictStore(), tmp_path / "first", exits)
    for dog in [*dogs, first]:
        dog.start()
    time.sleep(3.0)
    for dog in [*dogs, first]:
        dog.stop()
    assert exits == [] and not list(tmp_path.rglob("summary.json"))


def test_a_collective_failing_after_a_declared_hang_waits_for_the_watchdog_to_end_the_rank(tmp_path: Path) -> None:
    """A peer that read the hang verdict exits, so this rank's pending collective fails before its own
    watchdog has noticed the declaration: the failure handler yields, and the rank ends as hung (its exit
    code and record), not as a second, misleading 'a collective failed'. Without a declaration it returns
    at once: a peer that really died is reported as such, without delay."""
    store, exits, ends = DictStore(), [], []
    waiting = Progress()
    waiting.enter("sync")  # not armed: this rank never declares a hang itself, however slowly the test runs
    dog = watchdog(0, waiting, store, tmp_path, exits)
    dog.on_end = ends.append
    dog.start()
    began = time.monotonic()
    dog.yield_to_a_declared_hang()
    assert time.monotonic() - began < 2 * dog.tick + 1 and exits == [] and ends == []  # yielding waits that long at least
    store.set("t/hang", json.dumps({"rank": 1, "time": time.time()}))
    dog.yield_to_a_declared_hang()
    assert exits == [EXIT_HANG] and [(end.outcome, end.reason.split(";")[0]) for end in ends] == [("hung", "rank 1 found the job hung")]
    dog.stop()


# ---------------------------------------------------------------- values read from the store are checked

GOOD_BEAT = {"rank": 1, "host": "node1", "pid": 4242, "sent": 1000.0, "step": 7, "phase": "sync", "phase_s": 1.0, "stalled_s": 0.5}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"host": "evil;reboot"}, "is not a host name"),
        ({"host": "-rf"}, "is not a host name"),
        ({"host": "a" * 300}, "is not a host name"),
        ({"host": "node9"}, "the process group has it on 'node1'"),
        ({"rank": 0}, "rank 1's heartbeat says rank 0"),
        ({"rank": True}, "expected an integer"),
        ({"step": -1}, "expected an integer"),
        ({"pid": "4242"}, "expected an integer"),
        ({"sent": float("nan")}, "expected a number of seconds"),
        ({"stalled_s": -5}, "expected a number of seconds"),
        ({"phase": "hacked"}, "is not one of"),
        ({"extra": 1}, "expected ['host'"),
    ],
)
def test_a_heartbeat_is_believed_only_in_the_shape_a_rank_writes_it(change: dict, why: str) -> None:
    assert Heartbeat.from_json(json.dumps(GOOD_BEAT), rank=1, host="node1") == Heartbeat(**GOOD_BEAT)
    with pytest.raises(BadValue, match=re.escape(why)):
        Heartbeat.from_json(json.dumps({**GOOD_BEAT, **change}), rank=1, host="node1")


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", "[" * 100_000, json.dumps({**GOOD_BEAT, "host": "x" * 5000})])
def test_a_heartbeat_that_is_not_one_is_a_bad_value(text: str) -> None:
    with pytest.raises(BadValue):
        Heartbeat.from_json(text, rank=1, host=None)


def logged_watchdog(rank: int, progress: Progress, store: DictStore, folder: Path, exits: list[int], lines: list[str]) -> Watchdog:
    dog = watchdog(rank, progress, store, folder, exits)
    dog.log = lines.append
    return dog


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_bad_values_in_the_store_are_ignored_with_one_line_and_the_watchdog_goes_on(tmp_path: Path) -> None:
    """Without a token (one user's machine) values are unsigned, but still checked: a malformed hang mark or
    heartbeat killed the watchdog thread (json.loads, Heartbeat(**...)), so a later real hang ended no rank."""
    store, exits, lines = DictStore(), [], []
    waiting = Progress()
    waiting.enter("sync")  # not armed: this rank never declares a hang itself, however slowly the test runs
    dog = logged_watchdog(0, waiting, store, tmp_path, exits, lines)
    dog.start()
    for text in [b"not json", b'{"rank": "0"}', b'{"rank": 7, "time": 1}', b"[" * 100_000, b'{"rank": 1}', b"\xff\xfe"]:
        store.data["t/hang"] = text
        time.sleep(2 * dog.tick)
    assert exits == [] and dog._thread.is_alive() and not (tmp_path / "summary.json").exists()
    assert len([line for line in lines if "ignoring the rendezvous store's value" in line]) == 1, lines
    store.data["t/hang"] = json.dumps({"rank": 1, "time": time.time()}).encode()  # a rank's real mark still counts
    assert wait_for(lambda: exits == [EXIT_HANG], 10)
    dog.stop()


class CountedStore(DictStore):
    """A DictStore that counts the reads of one key: a test waits for the watchdog's reads, not for the clock."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key, self.reads = key, 0

    def check(self, keys: list[str]) -> bool:
        self.reads += self.key in keys
        return super().check(keys)


def test_a_host_that_is_not_the_ranks_own_never_reaches_unresponsive_nodes(tmp_path: Path) -> None:
    """A heartbeat naming another host under rank 1's key (written by anyone who reaches the store) is refused
    against the hosts the ranks gathered through the process group, and is no evidence that rank 1 stalled: no
    hang while it is there. Once rank 1's own last heartbeat is what its key holds (it froze), only node1 is named."""
    store, exits, lines = CountedStore("t/hb/1"), [], []
    dog = logged_watchdog(0, stalled(7, "sync"), store, tmp_path, exits, lines)
    dog.know_hosts(["node0", "node1"])
    store.data["t/hb/1"] = json.dumps({**GOOD_BEAT, "host": "ddnode9", "sent": time.time() - 100}).encode()
    dog.start()
    assert wait_for(lambda: store.reads >= 5, 20)  # rank 0 is past its 1 s timeout at every one of these reads
    assert exits == [] and not (tmp_path / "summary.json").exists()
    assert any("the process group has it on 'node1'" in line for line in lines)
    store.data["t/hb/1"] = json.dumps({**GOOD_BEAT, "sent": time.time() - 100}).encode()
    assert wait_for(lambda: exits == [EXIT_HANG], 20)
    assert (tmp_path / "unresponsive-nodes").read_text() == "node1\n"


@pytest.mark.parametrize("tamper", ["deleted", "replayed"])
def test_a_deleted_or_replayed_heartbeat_is_no_evidence_of_a_stall(tmp_path: Path, tamper: str) -> None:
    """Rank 1 is in a long eval (its heartbeat kept fresh); rank 0 waits in its next collective past the hang timeout.
    Another user deletes rank 1's key, or puts back an older heartbeat rank 1 wrote: the freshest one read grows
    stale, but a key that no longer holds it says nothing of rank 1. No hang, no node named, one line."""
    import threading

    store, exits, lines = CountedStore("t/hb/1"), [], []
    dog = logged_watchdog(0, stalled(7, "sync"), store, tmp_path, exits, lines)
    dog.know_hosts(["node0", "node1"])
    alive = threading.Event()
    alive.set()

    def rank_1_in_eval() -> None:
        while alive.is_set():
            store.data["t/hb/1"] = json.dumps({**GOOD_BEAT, "phase": "eval", "sent": time.time()}).encode()
            time.sleep(0.05)

    beating = threading.Thread(target=rank_1_in_eval, daemon=True)
    beating.start()
    dog.start()
    assert wait_for(lambda: store.reads >= 2, 30)  # rank 0 past its timeout reads rank 1's fresh heartbeat
    alive.clear()
    beating.join()
    if tamper == "deleted":
        del store.data["t/hb/1"]
    else:
        store.data["t/hb/1"] = json.dumps({**GOOD_BEAT, "phase": "eval", "sent": time.time() - 60}).encode()
    reads = store.reads
    # A read each tick (at least dog.tick apart): past the time the freshest one read goes stale, by two seconds.
    assert wait_for(lambda: store.reads >= reads + (dog.stale_after + 2) / dog.tick, 120)
    assert exits == [] and not (tmp_path / "summary.json").exists() and not (tmp_path / "unresponsive-nodes").exists()
    assert [line for line in lines if "not counted as a stall" in line] == [
        "watchdog: rank 1's heartbeat in the rendezvous store was removed or replaced by another user's write; not counted as a stall "
        "(a real hang then ends at the collective timeout); later ones without a line"
    ]
    dog.stop()


def test_one_store_call_that_misses_its_deadline_is_not_the_stores_end(tmp_path: Path) -> None:
    """A busy store host answers one call late: that call has no answer, the next ones do, and the store is not
    "gone" (which would end the job as hung at the next stall); MISSES_FOR_GONE calls in a row without one are."""
    import threading

    release = threading.Event()

    class OnceSlow(DictStore):
        slow = 1

        def get(self, key: str) -> bytes:
            if self.slow:
                self.slow -= 1
                release.wait(10)
            return super().get(key)

    store = OnceSlow()
    store.set("t/k", "v")
    guarded = GuardedStore(lambda: store, 0.3, prefix="t/")
    assert guarded.get("k") is None and not guarded.gone and guarded.missed == 1
    release.set()
    assert guarded.get("k") == "v" and not guarded.gone and guarded.misses == 0
    release.clear()
    store.slow = MISSES_FOR_GONE
    for _ in range(MISSES_FOR_GONE):
        guarded.get("k")
    assert guarded.gone
    release.set()
    guarded.close()


def test_an_exception_inside_a_tick_is_one_line_and_the_watchdog_goes_on(tmp_path: Path) -> None:
    class Flaky(Progress):
        failures = 0

        def stalled_s(self, now: float) -> float:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("a bug in one tick")
            return super().stalled_s(now)

    progress, exits, lines = Flaky(), [], []
    progress.step_done(3)
    progress.enter("sync")
    store = DictStore()
    store.data["t/hb/1"] = json.dumps({**GOOD_BEAT, "sent": time.time() - 100}).encode()  # rank 1 froze long ago
    dog = logged_watchdog(0, progress, store, tmp_path, exits, lines)
    dog.start()
    progress.failures = 5  # the next five ticks raise
    assert wait_for(lambda: exits == [EXIT_HANG], 20), lines  # the hang after the failures is still found
    assert [line for line in lines if "check failed" in line] == [
        "watchdog: a check failed (RuntimeError: a bug in one tick); it goes on, later failures without a line"
    ]


def test_stop_returns_only_once_no_store_call_is_in_flight(tmp_path: Path) -> None:
    """A finished rank tears down its process group (rank 0 hosts the store) and exits right after stop(): a check
    still talking to the store then ended it in std::terminate. stop() waits for the check, then closes the store."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class SlowStore(DictStore):
        def check(self, keys: list[str]) -> bool:
            entered.set()
            release.wait(5)
            return super().check(keys)

    exits: list[int] = []
    dog = watchdog(0, stalled(7, "sync"), SlowStore(), tmp_path, exits)
    dog.start()
    assert entered.wait(10)  # a check is in the store now
    threading.Timer(0.3, release.set).start()
    dog.stop()
    assert not dog._thread.is_alive() and dog.store.gone and dog.store._store is None
    assert exits == []
