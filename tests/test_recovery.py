"""In-process recovery's pure parts (train/recovery.py): who replaces whom, when it falls back, the collective
timeout rule, the per-step RNG. The real thing, with processes killed, is tests/test_recovery_dist.py."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from train import recovery
from train.recovery import CollectiveClock, Decision, collective_timeout, decide, step_seed

ROSTER = {0: "r0", 1: "r1", 2: "r2", 3: "r3"}
HOSTS = {"r0": "n1", "r1": "n1", "r2": "n2", "r3": "n2", "s0": "n1", "s1": "n3"}


def test_a_dead_rank_is_replaced_by_a_standby_on_another_node_when_one_is_alive() -> None:
    decision = decide(0, ROSTER, {1: "r1"}, HOSTS, ["s0", "s1"])
    assert decision.fallback is None
    assert decision.replacements == {1: "s1"}  # s0 shares n1 with the rank that died
    assert decision.roster == {0: "r0", 1: "s1", 2: "r2", 3: "r3"} and decision.generation == 1


def test_the_dead_ranks_node_is_used_when_it_is_the_only_place() -> None:
    assert decide(2, ROSTER, {1: "r1"}, HOSTS, ["s0"]).replacements == {1: "s0"}


def test_two_deaths_take_two_standbys_in_rank_order() -> None:
    decision = decide(0, ROSTER, {1: "r1", 3: "r3"}, HOSTS, ["s0", "s1"])
    assert decision.replacements == {1: "s1", 3: "s0"}


def test_a_lost_nodes_ranks_go_together_to_the_standbys_of_one_spare_node() -> None:
    """ddnode2 lost (ranks 2 and 3): the spare n3 hosts two standbys, and an older one (the store task's new one) waits
    on n1. Both ranks go to n3, so the new world keeps two ranks a node; where no node has standbys enough, each rank
    takes one on another node than its own, as for one death."""
    hosts = {**HOSTS, "s0": "n3", "s1": "n3", "s2": "n1"}
    decision = decide(0, ROSTER, {2: "r2", 3: "r3"}, hosts, ["s2", "s0", "s1"], rank0_hosts_store=False)
    assert decision.fallback is None and decision.replacements == {2: "s0", 3: "s1"}
    assert decide(0, ROSTER, {2: "r2", 3: "r3"}, {**hosts, "s1": "n2"}, ["s2", "s0", "s1"]).replacements == {2: "s2", 3: "s0"}


def test_more_ranks_lost_than_standbys_falls_back_and_says_so() -> None:
    decision = decide(0, ROSTER, {1: "r1", 2: "r2"}, HOSTS, ["s1"])
    assert decision.fallback == "2 rank(s) lost (1, 2) and 1 standby is alive: more ranks lost than standbys"
    assert decision.replacements == {}


def test_no_live_standby_falls_back_and_says_so() -> None:
    assert decide(0, ROSTER, {3: "r3"}, HOSTS, []).fallback == "rank(s) 3 lost and no standby is alive"


def test_rank_0_lost_falls_back_when_it_hosts_the_store_and_is_replaced_when_a_store_task_does() -> None:
    assert decide(0, ROSTER, {0: "r0"}, HOSTS, ["s0", "s1"]).fallback == "rank 0 lost: it hosts the job's store, which the group is formed on"
    decision = decide(0, ROSTER, {0: "r0"}, HOSTS, ["s0", "s1"], rank0_hosts_store=False)
    assert decision.fallback is None and decision.replacements == {0: "s1"} and decision.roster[0] == "s1"


def test_a_decision_reads_back_as_written() -> None:
    decision = decide(4, ROSTER, {1: "r1"}, HOSTS, ["s1"])
    assert Decision.parse(decision.to_json(), generation=5, world_size=4) == decision


def test_the_collective_timeout_follows_the_slowest_step_above_a_floor_and_below_the_ceiling() -> None:
    assert collective_timeout(0.001, ceiling_s=300) == recovery.TIMEOUT_FLOOR_S
    # A big model's bucket over gloo: 2 s steps are healthy, and the timeout leaves them far behind.
    assert collective_timeout(2.0, ceiling_s=300) == 2.0 * recovery.TIMEOUT_MARGIN
    assert collective_timeout(60.0, ceiling_s=300) == 300


def test_the_clock_tightens_after_measured_steps_relaxes_around_one_rank_pauses_and_grows_with_a_slow_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_to: list[float] = []
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda timeout, group=None: set_to.append(timeout / timedelta(seconds=1)))
    clock = CollectiveClock(ceiling_s=300)
    clock.relax()  # a new group: the long timeout
    assert set_to == []  # it already is
    clock.measured(5.0)  # the first step of a generation (DDP rebuilds its buckets) is not counted
    for _ in range(recovery.MEASURED_STEPS - 1):
        clock.measured(0.001)
    assert set_to == [recovery.TIMEOUT_FLOOR_S]
    clock.relax()  # eval or a snapshot on rank 0 next
    assert set_to[-1] == 300
    clock.measured(0.001)
    for _ in range(recovery.MEASURED_STEPS - 1):
        clock.measured(0.2)  # slow but healthy
    assert set_to[-1] == pytest.approx(0.2 * recovery.TIMEOUT_MARGIN)
    clock.measured(0.21)  # within 25%: left as it is
    assert set_to[-1] == pytest.approx(0.2 * recovery.TIMEOUT_MARGIN)


def test_each_rank_and_step_has_its_own_seed_over_a_long_run() -> None:
    """32 ranks x 12,000 steps: no two (rank, step) pairs share a seed (a sum of weighted terms repeats once the step
    count passes the rank's weight), and a seed is a pure function of the position."""
    seeds = {step_seed(0, rank, step) for rank in range(32) for step in range(12_000)}
    assert len(seeds) == 32 * 12_000
    assert step_seed(3, 1, 7) == step_seed(3, 1, 7) != step_seed(4, 1, 7)


@pytest.mark.parametrize(("rank", "role"), [(0, "rank"), (3, "rank"), (4, "standby"), (5, "standby")])
def test_the_launchers_last_k_ranks_are_standbys_and_the_others_train_in_a_world_of_the_rest(rank: int, role: str) -> None:
    """A template starts K standbys as extra tasks of its step (DDPACK_STANDBYS): of 6 launcher ranks, 4 train."""
    environ = {"RANK": str(rank), "WORLD_SIZE": "6"}
    assert recovery.launcher_role(2, environ) == role
    assert environ == {"RANK": str(rank), "WORLD_SIZE": "4"}  # what train.distributed and the watchdog read next
    untouched = {"RANK": str(rank), "WORLD_SIZE": "6"}
    assert recovery.launcher_role(0, untouched) == "rank" and untouched["WORLD_SIZE"] == "6"


@pytest.mark.parametrize(("rank", "role"), [(0, "rank"), (3, "rank"), (4, "standby"), (5, "store")])
def test_with_a_store_task_the_launchers_last_process_serves_the_store_after_the_standbys(rank: int, role: str) -> None:
    """DDPACK_STORE_TASK=1 with one standby: of 6 launcher processes, 4 train, one waits, the last serves the store."""
    environ = {"RANK": str(rank), "WORLD_SIZE": "6"}
    assert recovery.launcher_role(1, environ, store_task=True) == role and environ["WORLD_SIZE"] == "4"
    with pytest.raises(recovery.RecoveryImpossible, match=r"^the store task leaves no rank to train: the launcher started 1 "):
        recovery.launcher_role(0, {"RANK": "0", "WORLD_SIZE": "1"}, store_task=True)


def test_standbys_that_leave_no_rank_to_train_are_one_line() -> None:
    with pytest.raises(recovery.RecoveryImpossible, match=r"^--standbys 2 leaves no rank to train: the launcher started 2 process\(es\) \(WORLD_SIZE=2\)$"):
        recovery.launcher_role(2, {"RANK": "0", "WORLD_SIZE": "2"})


def test_the_templates_setting_reaches_the_trainer_and_implies_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.config import parse_config

    monkeypatch.setenv("DDPACK_STANDBYS", "1")
    config = parse_config([])
    assert (config.standbys, config.recovery) == (1, True)
    assert parse_config(["--standbys", "0"]).recovery is False
    monkeypatch.delenv("DDPACK_STANDBYS")
    assert (parse_config([]).standbys, parse_config([]).recovery) == (0, False)


def test_the_store_task_reads_the_lost_nodes_the_job_program_names_once_each_change(tmp_path: Path) -> None:
    """The run folder's lost-nodes file (the job program's, from srun's node-failure line): its node names, read again
    only when the file changed; a line that is no node name is not one."""
    lost = tmp_path / ".ddpack-lost-nodes"
    assert recovery.lost_nodes(lost, (0, frozenset())) == (0, frozenset())  # none yet
    lost.write_text("ddnode2\n../etc\n")
    seen = recovery.lost_nodes(lost, (0, frozenset()))
    assert seen[1] == frozenset({"ddnode2"}) and recovery.lost_nodes(lost, seen) is seen


def test_standbys_whose_node_is_not_known_never_stand_for_a_spare_node_with_standbys_enough() -> None:
    """Two standbys not yet located (no node value read for them) count as no node: the lost node's two ranks still go
    together to the spare's two standbys, not one each to the unknown ones."""
    hosts = {"r0": "n1", "r1": "n1", "r2": "n2", "r3": "n2", "s2": "n3", "s3": "n3"}
    decision = decide(0, ROSTER, {2: "r2", 3: "r3"}, hosts, ["s0", "s1", "s2", "s3"])
    assert decision.replacements == {2: "s2", 3: "s3"}, decision


def test_a_second_node_written_within_one_clock_tick_of_the_first_is_still_read(tmp_path: Path) -> None:
    """The job program writes the lost-nodes file once a node, back to back: a second write with the same change time
    (one clock tick) is told by its size."""
    lost = tmp_path / ".ddpack-lost-nodes"
    lost.write_text("ddnode2\n")
    seen = recovery.lost_nodes(lost, (0, frozenset()))
    stamp = lost.stat().st_mtime_ns
    lost.write_text("ddnode2\nddnode3\n")
    os.utime(lost, ns=(stamp, stamp))
    assert recovery.lost_nodes(lost, seen)[1] == frozenset({"ddnode2", "ddnode3"})
