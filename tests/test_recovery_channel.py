"""In-process recovery's control channel on a shared cluster (issue 62, point 1): the store answers anyone who reaches
its port, so every recovery key is signed with the job's token under a prefix derived from it, and a value that does
not verify or parse is ignored with one line, never acted on. Here on a real TCPStore, key by key; the same against a
live job, with another user writing while it trains and a real death after, is tests/test_recovery_dist.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from entrypoint.plan import JOB_TOKEN_VAR
from train import recovery
from train.node_beats import LocalBeats
from train.recovery import Heartbeat, Membership, decide
from train.recovery_channel import Beat, Channel, Decision, NodeBeat

TOKEN = "3f9a0c1d5e7b2468ace013579bdf8642"
ENV = {JOB_TOKEN_VAR: TOKEN, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "SLURM_STEP_ID": "0"}
ROSTER = {0: "r0", 1: "r1", 2: "r2", 3: "r3"}
NODE, OTHER_NODE, THIRD_NODE = "0123456789abcdef", "fedcba9876543210", "00000000000000aa"


def client(port: int, seconds: float = 10) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=seconds), wait_for_workers=False)


def channel(server: dist.TCPStore, environ: dict[str, str] = ENV) -> tuple[Channel, list[str]]:
    lines: list[str] = []
    return Channel.of_job(client(server.port), environ, lines.append), lines


def a_decision(generation: int = 0) -> Decision:
    return decide(generation, ROSTER, {1: "r1"}, {"r1": "n1", "s0": "n2"}, ["s0"])


def test_the_keys_lie_under_a_prefix_of_the_token_and_the_start_never_the_token_itself(server: dist.TCPStore) -> None:
    mine, _ = channel(server)
    other_token, _ = channel(server, {**ENV, JOB_TOKEN_VAR: "0" * 32})
    next_step, _ = channel(server, {**ENV, "SLURM_STEP_ID": "1"})
    assert len({mine.prefix, other_token.prefix, next_step.prefix}) == 3
    mine.register("r0", NODE)
    mine.beat_node(NODE, NodeBeat.of("n1", 1, {"r0": Beat(1, "n1")}))
    assert all(TOKEN not in key for key in server.list_keys())


@pytest.mark.parametrize(
    ("written", "why"),
    [
        (lambda key, signed: a_decision().to_json(), "not signed with this job's DDPACK_JOB_TOKEN"),  # as a standby writes it, unsigned
        (lambda key, signed: "0" * 64 + " " + a_decision().to_json(), "not signed"),  # a made-up signature
        (lambda key, signed: b"\xff\xfe not text", "not UTF-8 text"),
        (lambda key, signed: "[" * ((1 << 20) + 1000), "expected at most"),  # past the 1 MiB bound
        (lambda key, signed: signed(key, "[" * 5000), "not JSON (RecursionError)"),  # signed by the job: still parsed
        (lambda key, signed: signed(key, '{"generation": 1}'), "expected a decision's"),
        (lambda key, signed: signed(key, a_decision(3).to_json()), "generation '4'; expected 1"),
        (lambda key, signed: signed(key, a_decision().to_json().replace('"3": "r3"', '"7": "ddmallory"')), "names rank '7'"),
    ],
)
def test_a_decision_that_does_not_verify_or_parse_is_ignored_with_one_line(server: dist.TCPStore, written, why: str) -> None:
    reader, lines = channel(server)
    key = reader.prefix + reader.generation_key(0, "decision")
    server.set(key, written(key, reader.signer.seal))
    for _ in range(3):  # polled every 20 ms by a waiting rank: one line, not one a poll
        assert reader.decision(0, world_size=4) is None and not reader.decided(0, world_size=4)
    assert len(lines) == 1 and why in lines[0] and "gen0/decision" in lines[0], lines


def test_the_real_decision_replaces_a_forged_one_and_one_decision_stands(server: dist.TCPStore) -> None:
    standby, _ = channel(server)
    another_standby, _ = channel(server)
    key = standby.prefix + standby.generation_key(0, "decision")
    server.set(key, '{"generation": 1, "fallback": "forged: every rank gives up"}')
    ours = a_decision()
    standby.write_decision(0, ours, world_size=4)
    assert standby.decision(0, world_size=4) == ours
    later = decide(0, ROSTER, {2: "r2"}, {}, ["s0"])
    another_standby.write_decision(0, later, world_size=4)  # a second standby's view comes too late: the first stands
    assert another_standby.decision(0, world_size=4) == ours


def test_a_deleted_or_forged_heartbeat_is_no_news_and_never_waits_on_the_store(server: dist.TCPStore) -> None:
    """A missing key read with multi_get waits out the store's timeout and raises: the standby that did that left the
    job. Read through the channel, a deleted key is None at once (the client's timeout is an hour here): a node's
    heartbeat deleted, another forged, a registration forged."""
    writer, _ = channel(server)
    reader = Channel(client(server.port, seconds=3600), prefix=writer.prefix, signer=writer.signer, log=print)
    for member, node in (("r0", NODE), ("r1", OTHER_NODE), ("r2", THIRD_NODE)):
        writer.register(member, node)
    writer.beat_node(NODE, NodeBeat.of("n1", 1, {"r0": Beat(5, "n1")}))
    writer.beat_node(OTHER_NODE, NodeBeat.of("n2", 1, {"r1": Beat(9, "n2")}))
    server.delete_key(writer.prefix + writer.node_key(OTHER_NODE))
    server.set(writer.prefix + writer.node_key(THIRD_NODE), "ddmallory-box 1 0 r2:99999:0")
    server.set(writer.prefix + writer.member_key("r3"), NODE)  # unsigned: r3 is not where this says
    assert reader.beats(["r0", "r1", "r2", "r3"]) == {"r0": Beat(5, "n1"), "r1": None, "r2": None, "r3": None}


def test_the_store_holds_one_heartbeat_a_node_that_names_every_member_and_a_members_registration_is_not_needed(
    server: dist.TCPStore,
) -> None:
    """Eight members on a node: one signed value for the node, one read of it for all eight. A member whose
    registration another user deleted is found in its node's value all the same."""
    job, _ = channel(server)
    members = {f"r{rank}": Beat(rank + 1, "n1", 40, (0, 3) if rank == 5 else None) for rank in range(8)}
    job.register("r0", NODE)
    job.beat_node(NODE, NodeBeat.of("n1", 1, members))
    assert [k for k in server.list_keys() if "/hb/" in k] == [job.prefix + job.node_key(NODE)]
    reader, lines = channel(server)
    assert reader.beats(list(members)) == members and not lines  # the waiting count of r5 too, for the frozen rule


def test_a_standby_is_one_that_registered_a_signed_node_not_an_index_someone_bumped(server: dist.TCPStore) -> None:
    job, _ = channel(server)
    first = job.new_standby()
    job.register(first, NODE)
    server.add(job.prefix + job.STANDBYS, 1000)  # another user's add
    server.set(job.prefix + job.member_key("s7"), OTHER_NODE)
    second = job.new_standby()
    assert job.standbys() == [first]  # the second has not registered yet
    job.register(second, OTHER_NODE)
    assert job.standbys() == [first, second] == ["s0", "s1001"]


def test_a_failure_counts_only_as_a_members_signed_report(server: dist.TCPStore) -> None:
    job, _ = channel(server)
    server.add(job.prefix + job.generation_key(0, "failed"), 5)
    server.set(job.prefix + job.generation_key(0, "failed/r0"), "1")
    assert not job.failure_reported(0, ["r0", "r2"])
    job.report_failure(0, "r2")
    assert job.failure_reported(0, ["r0", "r2"]) and not job.failure_reported(0, ["r0"])


def test_closed_is_believed_only_when_the_job_signed_it(server: dist.TCPStore) -> None:
    job, lines = channel(server)
    server.set(job.prefix + job.CLOSED, "1")
    assert not job.closed() and len(lines) == 1
    job.close()
    assert job.closed()


def test_without_a_token_the_values_are_plain_on_one_users_machine(server: dist.TCPStore) -> None:
    job, _ = channel(server, {})
    job.write_decision(0, a_decision(), world_size=4)
    assert server.get(job.prefix + job.generation_key(0, "decision")).decode() == a_decision().to_json()


class FlakyStore:
    """A store client whose first `fails` sets raise, as one lost packet or a busy store host makes them."""

    def __init__(self, store: dist.TCPStore, fails: int) -> None:
        self.store, self.fails = store, fails

    def set(self, key: str, value: str) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError("Connection reset by peer")
        self.store.set(key, value)


def test_a_heartbeat_goes_on_after_store_errors(server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    job, _ = channel(server)
    flaky = FlakyStore(client(server.port), fails=0)
    monkeypatch.setattr(recovery, "_store", lambda is_master, connect_s=0: flaky)
    heart = Heartbeat(job, "r1", "n1", local=LocalBeats.open(ENV, TOKEN, tmp_path))
    try:
        flaky.fails = 3
        deadline = time.monotonic() + 60
        while (beat := job.beats(["r1"])["r1"]) is not None and beat.count < 8 and time.monotonic() < deadline:
            time.sleep(recovery.HEARTBEAT_S)
        assert heart.errors == 3 and job.beats(["r1"])["r1"].count >= 8
    finally:
        heart.stop()


class StoppedHeart:
    waiting: tuple[int, int] | None = None

    def stop(self) -> None:
        pass


@pytest.mark.parametrize(("run_over", "counted_dead", "closed"), [(True, False, True), (False, False, False), (True, True, False)])
def test_only_the_end_of_the_whole_run_sends_the_standbys_away(
    server: dist.TCPStore, run_over: bool, counted_dead: bool, closed: bool
) -> None:
    """A rank that ends alone (its own error, or counted dead while it was only late) leaves the standbys watching:
    the others may still need one."""
    job, _ = channel(server)
    member = Membership(
        channel=job, heartbeat=StoppedHeart(), member="r1", rank=1, generation=0, world_size=4, backend="gloo",
        device=None, collective_timeout_s=30,
    )  # fmt: skip
    member.counted_dead = counted_dead
    member.close(run_over=run_over)
    assert job.closed() is closed


def test_a_rank_waiting_on_a_collective_gives_up_only_on_the_jobs_own_decision(server: dist.TCPStore) -> None:
    job, lines = channel(server)
    member = Membership(
        channel=job, heartbeat=StoppedHeart(), member="r0", rank=0, generation=0, world_size=4, backend="gloo",
        device=None, collective_timeout_s=30,
    )  # fmt: skip
    server.set(job.prefix + job.generation_key(0, "decision"), a_decision().to_json())
    member.abandon_if_decided()  # another user's decision: no PeerDeclaredDead
    assert len(lines) == 1
    threading.Thread(target=job.write_decision, args=(0, a_decision(), 4)).run()
    with pytest.raises(recovery.PeerDeclaredDead):
        member.abandon_if_decided()


def test_the_launchers_standbys_are_found_by_name_whatever_the_counter_says(server: dist.TCPStore) -> None:
    """Another user who bumps the standbys' counter before the standbys have warmed up cannot hide them: the launcher's
    K standby tasks are s0..s<K-1> by their task; only a standby started by hand takes an index from the counter."""
    job, _ = channel(server)
    job.launched = 2
    server.add(job.prefix + job.STANDBYS, 5000)  # another user's add, before anyone registered
    for index in range(2):
        job.register(job.new_standby(index), NODE)
    by_hand = job.new_standby()
    job.register(by_hand, OTHER_NODE)
    assert job.standbys() == ["s0", "s1"] and by_hand == "s5002"  # past the cap of indexes read: not listed, not hidden


def test_a_rank_that_waits_on_a_collective_says_so_in_its_heartbeat(server: dist.TCPStore) -> None:
    """The waiting count (a frozen peer's only sign) travels in the waiting rank's own beats, not in a key a rank."""
    job, lines = channel(server)
    heart = StoppedHeart()
    member = Membership(
        channel=job, heartbeat=heart, member="r1", rank=1, generation=2, world_size=4, backend="gloo",
        device=None, collective_timeout_s=30,
    )  # fmt: skip
    member.abandon_if_decided(waited_s=recovery.WAITING_S)
    assert heart.waiting == (2, 1) and not lines
