"""In-process recovery's heartbeats on one node (train/node_beats.py, issue 62 point 6): each member beats in a file of
the node, the node's two lowest fresh members write one store value for all of them, so the store's heartbeat traffic
grows with nodes, not ranks; a dead or frozen writer is replaced and never makes its node-mates look dead."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from entrypoint.plan import JOB_TOKEN_VAR
from train import recovery
from train.node_beats import TAKEOVER_S, LocalBeat, LocalBeats, process_state, this_process
from train.recovery import Heartbeat
from train.recovery_channel import Beat, Channel, NodeBeat

TOKEN = "3f9a0c1d5e7b2468ace013579bdf8642"
ENV = {JOB_TOKEN_VAR: TOKEN, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "SLURM_STEP_ID": "0", "MASTER_PORT": "29500"}
NOW = 10**12


def beat_at(age_s: float, count: int = 1) -> LocalBeat:
    return LocalBeat(count, NOW - int(age_s * 1e9))


def test_the_writers_are_the_two_lowest_fresh_members_ranks_before_standbys() -> None:
    beats = {"s0": beat_at(0), "r10": beat_at(0), "r2": beat_at(0), "r1": beat_at(TAKEOVER_S * 2)}  # r1 dead or frozen
    assert LocalBeats.writers(beats, NOW) == ["r2", "r10"]
    assert LocalBeats.writers({"s0": beat_at(0), "r1": beat_at(TAKEOVER_S * 2)}, NOW) == ["s0"]


def test_a_beat_reads_back_whole_with_its_waiting_count(tmp_path: Path) -> None:
    node = LocalBeats.open(ENV, TOKEN, tmp_path)
    node.write("r3", LocalBeat(7, 123, (2, 5)))
    node.write("s1", LocalBeat(9, 456))
    (node.path / "r4").write_text("garbage")  # skipped, rewritten at its next beat
    assert node.read() == {"r3": LocalBeat(7, 123, (2, 5)), "s1": LocalBeat(9, 456)}
    assert LocalBeats.open(ENV, TOKEN, tmp_path).node == node.node  # every member of the node reads one id


def test_a_directory_another_could_write_in_is_not_used(tmp_path: Path) -> None:
    shared = LocalBeats.open(ENV, TOKEN, tmp_path).path
    shared.chmod(0o777)
    mine = LocalBeats.open(ENV, TOKEN, tmp_path)
    assert mine.path != shared and not os.stat(mine.path).st_mode & 0o077
    other_job = LocalBeats.open({**ENV, "MASTER_PORT": "29501"}, TOKEN, tmp_path)
    assert other_job.path.name != shared.name and TOKEN not in shared.name


def test_three_members_make_one_store_key_and_a_dead_writers_place_is_taken(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """r0, r1 and s0 beat on one node: one `hb/` key in the store names all three. r0 (a writer) dies as a SIGKILL
    leaves it (its file stays, its count stands still): r1 and s0 go on writing, their counts rise, r0's does not and
    its age, measured on the node, grows."""
    clients: list[dist.TCPStore] = []

    def store(is_master: bool, connect_s: float = 0) -> dist.TCPStore:
        clients.append(dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10), wait_for_workers=False))
        return clients[-1]

    monkeypatch.setattr(recovery, "_store", store)
    monkeypatch.setattr(LocalBeats, "leave", lambda self, member: None)  # a SIGKILLed member cleans up nothing
    job = Channel.of_job(store(False), ENV, print)
    hearts = {m: Heartbeat(job, m, "n1", local=LocalBeats.open(ENV, TOKEN, tmp_path)) for m in ("r0", "r1", "s0")}
    try:
        read = lambda: job.beats(["r0", "r1", "s0"])  # noqa: E731
        deadline = time.monotonic() + 60
        while any(b is None or b.count < 4 for b in read().values()) and time.monotonic() < deadline:
            time.sleep(recovery.HEARTBEAT_S)
        assert len([k for k in server.list_keys() if "/hb/" in k]) == 1
        hearts["r0"].stop()
        time.sleep(2 * recovery.HEARTBEAT_S)  # its last beat written
        before = read()
        while any(read()[m].count < before[m].count + 4 for m in ("r1", "s0")) and time.monotonic() < deadline:
            time.sleep(recovery.HEARTBEAT_S)
        after = read()
        assert after["r0"].count == before["r0"].count and after["r0"].age_ms > before["r0"].age_ms, (before, after)  # seen on the node
        assert all(after[m].count >= before[m].count + 4 for m in ("r1", "s0")), (before, after)
        # Writers are judged at a moment: a beat held back past TAKEOVER_S on a loaded host (CI's 2 cores) drops its member
        # for that moment only. So the test waits for a moment both are fresh, and r0 is never one again.
        writers = lambda: LocalBeats.writers(hearts["r1"]._local.read())  # noqa: E731
        seen = [writers()]
        while seen[-1] != ["r1", "s0"] and time.monotonic() < deadline:
            time.sleep(recovery.HEARTBEAT_S / 5)
            seen.append(writers())
        assert seen[-1] == ["r1", "s0"] and not any("r0" in w for w in seen), seen
    finally:
        for heart in hearts.values():
            heart.stop()


def test_a_standby_judges_a_member_by_its_age_on_its_node_and_reads_a_young_nodes_head_only(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes of two ranks. r3's node still writes (its value is fresh) but r3 has not beaten there for 300 ms: once a
    survivor reports a failed collective, the standby's one look decides r3 dead and only r3 (no wait for its own
    clock: the age is the node's); before the report, nobody."""
    for name, value in {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(name, value)
    job = Channel.of_job(server, ENV, print)
    nodes = {"0000000000000001": {"r0": 0, "r1": 10}, "0000000000000002": {"r2": 20, "r3": 300}}
    for node, ages in nodes.items():
        for member in ages:
            job.register(member, node)
        job.beat_node(node, NodeBeat.of("n" + node[-1], NOW, {m: Beat(50, "n" + node[-1], age) for m, age in ages.items()}))
    lines: list[str] = []
    standby = recovery.Standby(world_size=4, host="spare", log=lines.append, index=0, launched=1)
    try:
        standby._watch()
        assert job.decision(0, 4) is None and not lines
        job.report_failure(0, "r0")
        standby._watch()
        decision = job.decision(0, 4)
        assert decision is not None and decision.dead == {3: "r3"} and decision.replacements == {3: "s0"}, (decision, lines)
    finally:
        standby.heartbeat.stop()


def test_a_live_member_on_a_node_the_job_lost_is_counted_dead_at_once_and_a_forged_fence_is_ignored(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r1's node n2 still beats (a node set DOWN whose processes Slurm could not kill) and no collective failed. Another
    user's unsigned `fenced` value naming n2 is ignored with one line; once the job fences n2 (the store task, told by
    the job program that Slurm dropped it), the standby's next look counts r1 dead and gives s0 its place: r1, alive,
    is never in a roster again."""
    for name, value in {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(name, value)
    job = Channel.of_job(server, ENV, print)
    for node, member, host in (("0000000000000001", "r0", "n1"), ("0000000000000002", "r1", "n2")):
        job.register(member, node)
        job.beat_node(node, NodeBeat.of(host, NOW, {member: Beat(50, host, 0)}))
    lines: list[str] = []
    standby = recovery.Standby(world_size=2, host="spare", log=lines.append, index=0, launched=1)
    try:
        server.set(job.prefix + job.FENCED, "n2")
        standby._watch()
        assert job.decision(0, 2) is None and len(lines) == 1 and "ignored the store's 'fenced'" in lines[0], lines
        job.fence(frozenset({"n2"}))
        standby._watch()
        decision = job.decision(0, 2)
        assert decision is not None and decision.dead == {1: "r1"} and decision.replacements == {1: "s0"}, (decision, lines)
        assert "its node left the job (n2: fenced)" in lines[-1], lines
    finally:
        standby.heartbeat.stop()


def test_a_lost_nodes_ranks_are_decided_together_though_they_go_silent_one_after_the_other(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ddnode2 lost: its last value says r2 last beat 300 ms before it, r3 200 ms. A survivor reports its collective
    failed: the first look finds r2 dead and r3 half-way, and decides nothing yet; a look once r3 is stale too decides
    both at once, to the spare's two standbys. (Deciding r2 alone left r3 in the new roster, and the group waited for
    it until the join timeout: on the test cluster a node set DOWN fell back so.)"""
    for name, value in {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(name, value)
    job = Channel.of_job(server, ENV, print)
    nodes = {"0000000000000001": ("n1", {"r0": 0, "r1": 10}), "0000000000000002": ("n2", {"r2": 300, "r3": 200})}
    for node, (host, ages) in nodes.items():
        for member in ages:
            job.register(member, node)
        job.beat_node(node, NodeBeat.of(host, NOW, {m: Beat(50, host, age) for m, age in ages.items()}))
    job.register("s1", "0000000000000003")
    job.beat_node("0000000000000003", NodeBeat.of("n3", NOW, {"s1": Beat(50, "n3", 0)}))
    lines: list[str] = []
    standby = recovery.Standby(world_size=4, host="n3", log=lines.append, index=0, launched=2)
    try:
        job.report_failure(0, "r0")
        standby._watch()
        assert job.decision(0, 4) is None, lines  # r3 is half-way to STALE_S: not yet
        while job.decision(0, 4) is None:  # the next looks, as the standby makes them every HEARTBEAT_S
            time.sleep(recovery.HEARTBEAT_S)
            standby._watch()
        decision = job.decision(0, 4)
        assert decision.dead == {2: "r2", 3: "r3"} and set(decision.replacements.values()) == {"s0", "s1"}, (decision, lines)
    finally:
        standby.heartbeat.stop()


def test_a_beat_names_its_process_and_runs_only_while_that_process_runs_here(tmp_path: Path) -> None:
    """A late beat's process is read back from /proc: this process runs; a child runs until SIGSTOPped (a frozen rank),
    and not once ended; a pid whose start time differs (reused, or another pid namespace's) is not claimed to."""
    pid, started = this_process()
    assert pid == os.getpid() and started > 0
    node = LocalBeats.open(ENV, TOKEN, tmp_path)
    node.write("r0", LocalBeat(3, 99, None, pid, started))
    assert node.read()["r0"] == LocalBeat(3, 99, None, pid, started) and node.read()["r0"].runs()
    child = subprocess.Popen(["sleep", "30"])
    try:
        state = process_state(child.pid)
        assert state is not None
        beat = LocalBeat(1, 0, None, child.pid, state[1])
        assert beat.runs() and not LocalBeat(1, 0, None, child.pid, state[1] + 1).runs()
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: not beat.runs())
        child.send_signal(signal.SIGCONT)
        wait_until(beat.runs)
        child.kill()
        wait_until(lambda: not beat.runs())  # a zombie until reaped: ended all the same
        child.wait()
        assert not beat.runs() and not LocalBeat(1, 0).runs()  # reaped; a beat naming no process
    finally:
        child.kill()
        child.wait()


def test_a_late_member_whose_process_runs_is_not_taken_for_frozen_nor_dead_and_a_stopped_ones_is(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node: r0 waits on a collective (its waiting count rises look by look), r1 and r2 have not beaten for 2 s (past
    FROZEN_S). While the node says both processes run (a heartbeat thread held back on a saturated node), no look
    decides, not even once a survivor reports its collective failed; once it says r2's does not (stopped, ended), the
    next look decides r2 dead, and only r2 (seen on the test cluster before: a live rank counted dead, its place taken)."""
    for name, value in {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(name, value)
    job = Channel.of_job(server, ENV, print)
    node = "0000000000000001"
    for member in ("r0", "r1", "r2"):
        job.register(member, node)
    lines: list[str] = []
    standby = recovery.Standby(world_size=3, host="spare", log=lines.append, index=0, launched=1)

    def look(at: int, r2_runs: bool) -> None:
        late = {"r1": Beat(9, "n1", 2000, None, True), "r2": Beat(9, "n1", 2000, None, r2_runs)}
        job.beat_node(node, NodeBeat.of("n1", NOW + at, {"r0": Beat(50 + at, "n1", 0, (0, at)), **late}))
        standby._watch()

    try:
        for at in range(1, 4):
            look(at, r2_runs=True)
            time.sleep(recovery.HEARTBEAT_S)
        assert job.decision(0, 3) is None and not lines, lines
        job.report_failure(0, "r0")
        look(4, r2_runs=True)
        assert job.decision(0, 3) is None and not lines, lines
        look(5, r2_runs=False)
        decision = job.decision(0, 3)
        assert decision is not None and decision.dead == {2: "r2"} and decision.replacements == {2: "s0"}, (decision, lines)
    finally:
        standby.heartbeat.stop()


def test_the_nodes_writer_says_a_late_members_process_runs_until_it_is_stopped(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real heartbeat (r0, the node's writer) and a member r1 whose beat file stopped 1 s ago: the node's value in the
    store marks r1 running (`+`) while its process (a child here) runs, and no more once it is SIGSTOPped."""
    monkeypatch.setattr(
        recovery,
        "_store",
        lambda is_master, connect_s=0: dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10), wait_for_workers=False),
    )
    job = Channel.of_job(recovery._store(False), ENV, print)
    local = LocalBeats.open(ENV, TOKEN, tmp_path)
    child = subprocess.Popen(["sleep", "30"])
    state = process_state(child.pid)
    assert state is not None
    local.write("r1", LocalBeat(5, time.monotonic_ns() - 10**9, None, child.pid, state[1]))
    heart = Heartbeat(job, "r0", "n1", local=local)
    job.register("r1", local.node)
    try:
        running = lambda: (job.beats(["r1"])["r1"] or Beat(0, "")).running  # noqa: E731
        wait_until(running)
        child.send_signal(signal.SIGSTOP)
        wait_until(lambda: not running())
    finally:
        heart.stop()
        child.kill()
        child.wait()


def wait_until(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)
