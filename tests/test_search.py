"""Search beyond a grid (ddpack/jobs/search.py): random draws, and successive halving's decision as a function of
the points' records, with no Slurm at all. The verbs over them are tested with stand-in Slurm commands in
tests/test_experiments.py; the halving on the cluster in tests/test_lifecycle_cluster.py (DDPACK_LONG_TESTS=1)."""

from __future__ import annotations

import pytest

from ddpack.errors import HostError
from ddpack.jobs.search import Halving, PointNow, decide_rung, dimensions, draw_points, halving_step, keep_count, metric_at, reached


def test_each_rung_keeps_the_better_half_rounded_up_so_six_points_become_three_two_one() -> None:
    assert [keep_count(n) for n in (6, 3, 2, 1, 0)] == [3, 2, 1, 1, 0]


def test_the_worse_half_by_the_metric_is_paused_lowest_best_unless_highest_and_ties_go_to_the_lower_index() -> None:
    losses = {0: 0.5, 1: 0.1, 2: 0.9, 3: 0.3, 4: 0.7, 5: 0.2}
    assert decide_rung(losses) == [0, 2, 4]
    assert decide_rung(losses, highest=True) == [1, 3, 5]
    assert decide_rung({0: 0.5, 1: 0.5, 2: 0.5}) == [2]  # two go on: the lower indices
    assert decide_rung({0: None, 1: 0.9, 2: float("nan"), 3: 0.8}) == [0, 2]  # no value (or NaN) ranks last
    assert decide_rung({7: 1.0}) == []  # the last point in the race always goes on


def records_to(step: int, loss: float, *, every: int = 10) -> list[dict]:
    """A point's progress records every `every` steps to `step`, the loss constant at `loss`, then an eval."""
    return [{"kind": "progress", "time": s, "global_step": s, "loss": loss} for s in range(every, step + 1, every)] + [
        {"kind": "eval", "time": step, "global_step": step, "eval_loss": loss + 1}
    ]


def test_a_metric_at_a_rung_is_its_last_value_at_or_before_that_step() -> None:
    records = [{"kind": "progress", "global_step": s, "loss": 1 / s} for s in (10, 20, 30)] + [{"kind": "eval", "global_step": 25, "val": 3}]
    assert metric_at(records, "loss", 25) == pytest.approx(1 / 20) and metric_at(records, "val", 25) == 3.0
    assert metric_at(records, "val", 24) is None and metric_at(records, "missing", 30) is None
    assert reached(records, 30) and not reached(records, 31)


def test_a_rung_waits_for_every_point_in_the_race_then_decides_and_the_paused_are_out_of_the_next_rung() -> None:
    plan = Halving(rungs=(20, 40, 80), by="loss")
    losses = [0.6, 0.1, 0.5, 0.2, 0.4, 0.3]
    waiting = [PointNow(index=i, state="RUNNING", records=records_to(20 if i != 4 else 10, loss)) for i, loss in enumerate(losses)]
    assert halving_step(plan, [], waiting) == []  # point 4 is at step 10: nothing is decided
    at_20 = [PointNow(index=i, state="RUNNING", records=records_to(20, loss)) for i, loss in enumerate(losses)]
    (first,) = halving_step(plan, [], at_20)
    assert (first["rung"], first["kept"], first["paused"]) == (20, [1, 3, 5], [0, 2, 4])
    # The paused stopped at 20 (their jobs cancelled); the others go on. Point 5 reached 40 first: the rung waits.
    later = [PointNow(index=i, state="CANCELLED" if i in (0, 2, 4) else "RUNNING", records=records_to(20 if i in (0, 2, 4) else 40, loss))
             for i, loss in enumerate(losses)]  # fmt: skip
    (second,) = halving_step(plan, [first], later)
    assert (second["rung"], second["kept"], second["paused"], sorted(second["values"])) == (40, [1, 3], [5], ["1", "3", "5"])
    assert halving_step(plan, [first, second], later) == []  # 80 not reached by 1 and 3: waits, and 20 and 40 are never decided again


def test_a_winner_held_at_a_rung_stays_in_the_race_so_the_next_rung_waits_for_it() -> None:
    """Points 1 and 3 were held at 20 (their jobs cancelled while point 5 waited for a node) and kept there: until
    they are continued their state is CANCELLED, yet the next rung is theirs too. Without `waiting`, point 5 alone
    decided rung 40 (found on the cluster, a sweep bigger than its nodes)."""
    plan = Halving(rungs=(20, 40, 80), by="loss")
    first = {"rung": 20, "kept": [1, 3, 5], "paused": [0, 2, 4]}
    points = [PointNow(index=i, state="CANCELLED" if i != 5 else "RUNNING", records=records_to(40 if i == 5 else 20, 0.1 * i)) for i in range(6)]
    assert halving_step(plan, [first], points, waiting={1, 3}) == []  # 1 and 3 are at 20: rung 40 waits
    assert [(d["rung"], d["kept"]) for d in halving_step(plan, [first], points)] == [(40, [5])]  # what it was: 40 by point 5 alone


def test_a_point_that_ended_before_a_rung_is_out_of_it_and_rungs_reached_at_once_are_decided_in_one_look() -> None:
    plan = Halving(rungs=(20, 40), by="loss")
    points = [
        PointNow(index=0, state="FAILED", records=records_to(10, 0.0)),  # failed at 10: out, however good its loss
        PointNow(index=1, state="RUNNING", records=records_to(40, 0.3)),
        PointNow(index=2, state="COMPLETED", records=records_to(40, 0.2)),  # ended past both rungs: still ranked
        PointNow(index=3, state="RUNNING", records=records_to(40, 0.1)),
    ]
    first, second = halving_step(plan, [], points)
    assert (first["kept"], first["paused"]) == ([2, 3], [1]) and (second["kept"], second["paused"]) == ([3], [2])
    assert halving_step(plan, [], [PointNow(index=0, state="FAILED", records=[])]) == []  # nobody left in the race


def test_a_random_draw_is_the_same_for_the_same_seed_and_stays_inside_its_distribution() -> None:
    space = dimensions(["lr=loguniform(1e-4,1e-1)", "drop=uniform(0,0.5)", "layers=randint(2,3)", "opt=adam,sgd"], {})
    drawn = draw_points(space, 200, seed=3)
    assert drawn == draw_points(space, 200, seed=3) and drawn != draw_points(space, 200, seed=4)
    assert all(1e-4 <= float(p["lr"]) <= 1e-1 and 0 <= float(p["drop"]) <= 0.5 for p in drawn)
    assert {p["layers"] for p in drawn} == {"2", "3"} and {p["opt"] for p in drawn} == {"adam", "sgd"}
    below = sum(float(p["lr"]) < 1e-2 for p in drawn)  # log-uniform: two of the three decades lie below 1e-2
    assert 100 < below < 170
    with pytest.raises(HostError, match="randint\\(A,B\\) needs whole numbers A < B"):
        dimensions(["n=randint(1.5,3)"], {})


def test_points_at_an_undecided_rung_are_held_only_while_a_point_of_the_race_waits_for_a_node() -> None:
    from ddpack.jobs.search import hold_now

    plan = Halving(rungs=(20, 40), by="loss")
    points = [PointNow(index=0, state="RUNNING", records=records_to(20, 0.1)), PointNow(index=1, state="RUNNING", records=records_to(10, 0.2)),
              PointNow(index=2, state="PENDING", records=[])]  # fmt: skip
    assert hold_now(plan, [], points, held=set()) == [0]  # 0 is at 20, 1 is still on its way: 0 frees its node for 2
    assert hold_now(plan, [], points, held={0}) == []  # held already
    assert hold_now(plan, [], points[:2], held=set()) == []  # nobody queued: the race runs on
    first = {"rung": 20, "paused": [2], "kept": [0, 1]}
    assert hold_now(plan, [first], points, held=set()) == []  # 2 is out: its queue is nobody's wait; 40 not reached
