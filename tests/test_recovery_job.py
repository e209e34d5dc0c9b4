"""The job program's side of in-process recovery (enroot/ddpack_training.py, enroot/ddpack_step.py): when the trainer's
--recovery falls back, the restart decision says why, in one line and in its step-end record; the store task's end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ddpack.job_side import module
from train.outcome import RECOVERY_IMPOSSIBLE, RunEnd


@pytest.fixture(scope="module")
def node() -> ModuleType:
    return module("ddpack_training")


@pytest.fixture(scope="module")
def steps() -> ModuleType:
    return module("ddpack_step")


@pytest.fixture
def quick_store_wait(steps: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits for the store task's serving line and a rank's start line after srun's line, 0.5 s here (each step below
    outlives them)."""
    monkeypatch.setattr(steps, "SERVING_LINE_WAIT_S", 0.5)
    monkeypatch.setattr(steps, "GROUP_LINE_WAIT_S", 0.5)


def end_record(reason: str) -> str:
    return json.dumps({"time": 1.0, "kind": "end", "rank": 0, "outcome": "failed", "exit_code": 1, "reason": reason})


def test_the_fallback_is_read_from_rank_0s_end_record_of_this_step_only(node: ModuleType, tmp_path: Path) -> None:
    assert module("ddpack_step_records").RECOVERY_FALLBACK == RECOVERY_IMPOSSIBLE  # the trainer's words, which the job reads
    metrics = tmp_path / "metrics.jsonl"
    earlier = end_record("in-process recovery impossible: rank 0 lost: it hosts the job's store, which the group is formed on")
    metrics.write_text(earlier + "\n")
    since = metrics.stat().st_size
    assert node.StepRecords.read(metrics, since).fallback == ""  # the step before's, not this one's
    with metrics.open("a") as out:
        out.write(json.dumps({"kind": "progress", "global_step": 3}) + "\n")
        out.write(end_record("in-process recovery impossible: rank(s) 1 lost and no standby is alive") + "\n")
    assert node.StepRecords.read(metrics, since).fallback == "rank(s) 1 lost and no standby is alive"
    assert node.StepRecords.read(metrics, None).fallback == "rank(s) 1 lost and no standby is alive"
    assert node.StepRecords.read(tmp_path / "none.jsonl", None).fallback == ""
    metrics.write_text(end_record("a collective failed (RuntimeError: …)") + "\n")
    assert node.StepRecords.read(metrics, None).fallback == ""  # a failure without --recovery


def test_one_pass_counts_the_steps_recoveries_and_gives_the_ranks_hosts_after_the_newest(node: ModuleType, tmp_path: Path) -> None:
    """The job program reads a step's records once after it (and at each recovery's line during it): the recoveries
    counted, and where the ranks are after the newest one that names them (a record without `hosts`, of an older image,
    or damaged, leaves the last known)."""
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"kind": "recovery", "global_step": 40, "hosts": ["n1", "n3", "n2", "n2"]},
        {"kind": "progress", "global_step": 41},
        {"kind": "recovery", "global_step": 60, "hosts": ["n1", "n3", "n3", "n3"]},
        {"kind": "recovery", "global_step": 70},
        {"kind": "recovery", "global_step": 80, "hosts": "n1"},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "recovery", "hosts": [\n')
    wrote = node.StepRecords.read(metrics, None)
    assert (wrote.recovered, wrote.hosts, wrote.progress) == (5, ["n1", "n3", "n3", "n3"], "yes")
    assert node.StepRecords.read(metrics, metrics.stat().st_size).hosts is None
    assert node.StepRecords.read(tmp_path / "none.jsonl", 0).hosts is None


def test_the_restart_decision_says_why_recovery_fell_back_in_one_line_and_its_record(
    node: ModuleType, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    training = object.__new__(node.Training)
    training.run_dir, training.progress, training.fallback = tmp_path, "yes", "rank(s) 1 lost and no standby is alive"
    training.recovered = 0
    assert training.decide("restart", "restart", "failed", 1, "the step failed (exit 1); restarting it in this allocation") == "restart"
    said = capfd.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if line.strip()]
    assert lines[0].endswith("in-process recovery fell back to this decision: rank(s) 1 lost and no standby is alive"), lines
    record = json.loads((tmp_path / module("ddpack_records").DECISIONS).read_text().splitlines()[-1])
    assert record["kind"] == "step-end" and record["recovery_fallback"] == "rank(s) 1 lost and no standby is alive"


def test_the_standbys_go_one_a_node_after_the_ranks_and_rank_0_on_the_steps_first_node(node: ModuleType) -> None:
    """Each task's node for SLURM_HOSTFILE: the ranks in blocks, then the standbys one a node from the first, then the
    store task on the first node. A placement that chose ddnode2 first (its last step's node) still puts rank 0 and the
    store task on ddnode1: every task takes the step's first node, as Slurm sorts it, for the store's address."""
    assert node.task_hosts(["ddnode1", "ddnode2"], 2, 1) == ["ddnode1", "ddnode1", "ddnode2", "ddnode2", "ddnode1", "ddnode1"]
    assert node.task_hosts(["ddnode1", "ddnode2"], 2, 0) == ["ddnode1", "ddnode1", "ddnode2", "ddnode2"]  # no standby, no store task
    assert node.task_hosts(["ddnode2", "ddnode10", "ddnode1"], 1, 4) == [
        "ddnode1",
        "ddnode2",
        "ddnode10",
        "ddnode1",
        "ddnode2",
        "ddnode10",
        "ddnode1",
        "ddnode1",
    ]


def test_with_spares_the_standbys_live_on_the_spare_nodes_as_many_on_each_as_a_nodes_ranks(node: ModuleType) -> None:
    """Spare nodes host the standbys (DDPACK_SPARE_NODES): per_node on each spare, none on a node that trains, so one
    spare can take a lost node's ranks at once; the store task stays on the step's first node."""
    assert node.task_hosts(["ddnode1", "ddnode2"], 2, 2, ["ddnode3"]) == [
        *("ddnode1", "ddnode1", "ddnode2", "ddnode2"),
        *("ddnode3", "ddnode3"),
        "ddnode1",
    ]
    assert node.task_hosts(["ddnode3", "ddnode1"], 1, 2, ["ddnode10", "ddnode4"]) == [
        "ddnode1",
        "ddnode3",
        "ddnode4",
        "ddnode10",
        "ddnode1",
    ]


def test_with_spares_the_recovery_rule_puts_a_nodes_worth_of_standbys_on_each_spare_gpu_jobs_too(node: ModuleType) -> None:
    """The settings table's rule (enroot/ddpack_settings.py `recovery`): with spares, as many standbys on each as a node
    has ranks, where standbys are asked for or free, a CUDA job's included (a spare's GPUs idle anyway); none where
    they are refused (a count of 0) or cannot run (another program)."""
    rule = module("ddpack_settings").recovery
    on_spares = rule("auto", gpus=8, program="trainer", spares=2, per_node=8)
    assert (on_spares.standbys, on_spares.on_spares, on_spares.fields()["on_spares"]) == (16, True, True)
    assert rule("1", gpus=0, program="trainer", spares=1, per_node=2).standbys == 2
    assert rule("auto", gpus=8, program="trainer").standbys == 0  # no spares: no GPU of a node that trains idles
    assert rule("0", gpus=0, program="trainer", spares=1, per_node=2).standbys == 0
    assert rule("auto", gpus=0, program="own", spares=1, per_node=2).standbys == 0


def test_a_fallback_blames_the_dead_ranks_node_never_rank_0s(steps: ModuleType) -> None:
    """Ranks 0-1 on ddnode1, 2-3 on ddnode2; rank 3 is SIGKILLed and the survivors fall back (no standby): srun names
    ddnode1 first, but its ranks' end records say, as a field, that they crashed nothing. The crash rule (whose second
    hit on a node puts it in ExcNodeList) names ddnode2."""
    ends = [
        RunEnd(rank=r, world_size=4, host=h, outcome="failed", exit_code=1, reason=f"{RECOVERY_IMPOSSIBLE}x", cause="recovery-fallback")
        for r, h in ((0, "ddnode1"), (1, "ddnode1"), (2, "ddnode2"))
    ]
    lines = [end.line() for end in ends] + [
        "srun: error: ddnode1: tasks 0-1: Exited with exit code 1",
        "srun: error: ddnode2: task 2: Exited with exit code 1",
        "srun: error: ddnode2: task 3: Killed",
    ]
    script = f"import sys; sys.stdout.write({chr(10).join(lines) + chr(10)!r}); sys.exit(1)"
    step = steps.run_step([sys.executable, "-c", script])
    assert step.code == 1 and step.crashed == "ddnode2" and step.exits == {0: 1, 1: 1, 2: 1}


def fake_step(out: list[str], err: list[str], wait_s: float = 60, code: int = 0) -> list[str]:
    """srun's stand-in: the tasks' lines `out` on stdout, then srun's own `err` on stderr (two pipes, as srun's), then a
    wait of `wait_s`, as ranks wait for a store that is not there, unless it is ended (SIGTERM), which it says; `code`."""
    body = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('fake srun: terminated', flush=True), sys.exit(143)))\n"
        f"sys.stdout.write({''.join(line + chr(10) for line in out)!r}); sys.stdout.flush()\n"
        f"sys.stderr.write({''.join(line + chr(10) for line in err)!r}); sys.stderr.flush()\n"
        f"time.sleep({wait_s}); sys.exit({code})\n"
    )
    return [sys.executable, "-c", body]


SERVING = "[store] store task on ddnode1: serving the job's store at ddnode1:29500 (pid 7) for 4 ranks and their standbys"


@pytest.mark.parametrize(("status", "code"), [("Exited with exit code 1", 137), ("Exited with exit code 2", 2)])
def test_a_store_task_that_ends_before_it_serves_ends_the_step_at_once_with_one_line(
    steps: ModuleType, capfd: pytest.CaptureFixture[str], quick_store_wait: None, status: str, code: int
) -> None:
    """Ranks 0-3, a standby (task 4), the store task (task 5), which failed at its start (its port taken; or it refused its
    input: 2, which no restart retries): every rank would wait for the store until its collective timeout (300 s by
    default; a minute here). The job program ends the step when srun says so; rank 1's own end before it ends nothing."""
    lines = ["srun: error: ddnode2: task 1: Exited with exit code 1", f"srun: error: ddnode1: task 5: {status}"]
    step = steps.run_step(fake_step([], lines), end_wait=30, store_task=5)
    captured = capfd.readouterr()
    said = captured.out
    assert "fake srun: terminated" in said and step.code == code, said + captured.err  # ended by the job program, not by the minute
    assert said.count("ddpack: the job's store task") == 1, said
    assert (
        f"ddpack: the job's store task (task 5 on ddnode1) ended before it served the job's store ({status}; its lines above "
        "say why): no rank can start without it; ending the step" in said
    )


def test_a_store_task_that_ends_after_it_served_leaves_the_run_training_without_recovery(
    steps: ModuleType, capfd: pytest.CaptureFixture[str], quick_store_wait: None
) -> None:
    """Once it served, the ranks' group needs no store: the run goes on (only recovery is lost), said in one line, though
    srun's line (stderr) may be read before the store task's own (stdout); its end after the run's is no failure at all."""
    step = steps.run_step(fake_step([SERVING], ["srun: error: ddnode1: task 5: Killed"], wait_s=1), end_wait=30, store_task=5)
    said = capfd.readouterr().out
    assert step.code == 0 and "fake srun: terminated" not in said, said
    assert (
        "ddpack: the job's store task (task 5 on ddnode1) ended (Killed): the run goes on without in-process recovery; a rank's "
        "death now restarts the step" in said
    )
    done = RunEnd(rank=0, world_size=2, host="ddnode1", outcome="done", exit_code=0, reason="")
    step = steps.run_step(fake_step([done.line()], ["srun: error: ddnode1: task 3: Killed"], wait_s=1), end_wait=30, store_task=3)
    assert step.code == 0 and "store task" not in capfd.readouterr().out


@pytest.mark.parametrize(
    ("lines", "named"),
    [
        (["srun: error: ddnode1: task 4: Exited with exit code 1", "srun: error: ddnode2: task 2: Killed"], "2 on ddnode2"),
        (["srun: error: ddnode1: tasks 0,4: Killed"], "0,4 on ddnode1"),  # a node's rank and standby, killed together
        (["srun: error: ddnode1: tasks 0-1: Killed", "srun: error: ddnode2: tasks 2-3: Killed"], "0-1 on ddnode1"),  # said once
    ],
    ids=["a rank alone", "a rank and a standby", "two nodes' lines"],
)
def test_a_rank_that_dies_before_the_ranks_formed_their_group_ends_the_step_at_once(
    steps: ModuleType, capfd: pytest.CaptureFixture[str], quick_store_wait: None, lines: list[str], named: str
) -> None:
    """Rank 2 killed while it imported (the OOM killer, a node's bad library): the other ranks wait for it in the group's
    rendezvous, where no standby can take its place, until their collective timeout (on the test cluster: 300 s before
    this). The job program ends the step, once; a standby's own end (task 4) ends nothing."""
    step = steps.run_step(fake_step([], lines), end_wait=30, store_task=5, ranks=4)
    said = capfd.readouterr().out
    assert "fake srun: terminated" in said and step.code == 137, said
    assert said.count("ddpack: rank task") == 1 and (
        f"ddpack: rank task(s) {named} ended before the ranks formed their group (Killed; its lines above say why): a standby "
        "takes a place only in a group that formed, and the others would wait for it; ending the step" in said
    ), said


KILLED = "srun: error: ddnode2: task 2: Killed"


@pytest.mark.parametrize(
    ("out", "err"),
    [
        (["[rank 0/4] start: rank 0 world 4 local_rank 0/2 backend gloo device cpu host ddnode1"], [KILLED]),  # recovery's
        ([], ["slurmstepd-ddnode1: error: *** STEP 7.0 ON ddnode1 CANCELLED AT 2026-11-29T09:00:00 DUE TO PREEMPTION ***", KILLED]),
        ([], ["srun: error: ddnode2: task 2: User defined signal 1"]),  # the time limit's warning before the trainer's watcher
    ],
    ids=["after the group formed", "the step being stopped", "a stop's signal"],
)
def test_a_ranks_death_after_the_group_formed_or_in_a_stop_is_not_the_job_programs_to_end(
    steps: ModuleType, capfd: pytest.CaptureFixture[str], quick_store_wait: None, out: list[str], err: list[str]
) -> None:
    step = steps.run_step(fake_step(out, err, wait_s=1), end_wait=30, store_task=5, ranks=4)
    said = capfd.readouterr().out
    assert step.code == 0 and "fake srun: terminated" not in said and "rank task" not in said, said


def test_every_task_refusing_its_input_stays_bad_input_and_a_task_line_that_only_looks_like_sruns_is_passed_through(
    steps: ModuleType, capfd: pytest.CaptureFixture[str], quick_store_wait: None
) -> None:
    """srun names the store task among the others (they all refused their input, exit 2): srun ends the step itself, whose
    status stays 2 (not retried), and nothing is said of the store task. A task's own line that looks like srun's but
    names no tasks ("task 3,") is passed through; the readers go on."""
    lines = ["srun: error: ddnode1: task 3,: x", "srun: error: ddnode1: tasks 0-5: Exited with exit code 2"]
    step = steps.run_step(fake_step([], lines, wait_s=1, code=2), end_wait=30, store_task=5)  # srun's own end comes later
    captured = capfd.readouterr()
    assert step.code == 2 and "store task" not in captured.out and "task 3,: x" in captured.err, captured
    assert step.crashed == "ddnode1"  # srun's line after it was read


@pytest.mark.parametrize(
    ("end", "fallback", "crashed_nothing"),
    [
        ({"cause": "recovery-fallback", "reason": f"{RECOVERY_IMPOSSIBLE}rank 0 lost"}, "rank 0 lost", True),
        ({"cause": "peer", "reason": "a collective failed (RuntimeError: x)"}, None, True),
        ({"cause": "own", "reason": "OutOfMemoryError: CUDA out of memory"}, None, False),
        ({"cause": "counted-dead", "reason": f"{RECOVERY_IMPOSSIBLE}this rank (r1) was counted dead"}, None, True),
        ({"cause": "own", "reason": f"{RECOVERY_IMPOSSIBLE}rank 0 lost"}, None, False),  # the words do not decide
        ({"reason": f"{RECOVERY_IMPOSSIBLE}rank 0 lost"}, "rank 0 lost", True),  # an image older than the field
    ],
)
def test_the_job_decides_from_the_ends_cause_not_its_words(
    steps: ModuleType, end: dict, fallback: str | None, crashed_nothing: bool
) -> None:
    assert module("ddpack_step_records").fallback_reason(end) == fallback and steps.left_by_a_peer(end) is crashed_nothing


def test_an_end_records_cause_is_one_of_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cause 'peer died'"):
        RunEnd(rank=0, world_size=1, host="h", outcome="failed", exit_code=1, cause="peer died")


class Facts:
    """JobFacts as far as the standby rule asks: the GPUs a node the job asked for."""

    def __init__(self, gpus: int) -> None:
        self.gpus_per_node = gpus


@pytest.mark.parametrize(
    ("app_cmd", "env", "command", "standbys", "why"),
    [
        ("", {}, ["entrypoint"], 1, "the default where the nodes have no GPUs"),
        ("python train.py", {}, ["entrypoint"], 0, "the image runs its own command"),
        ("python train.py", {"DDPACK_TRAIN_ARGS": "--epochs 2"}, ["entrypoint", "--epochs", "2"], 1, "the default where"),
        (None, {}, ["entrypoint"], 0, "no make sqsh record says the image runs the bundled trainer"),
        ("", {}, ["entrypoint", "--nproc-per-node", "2"], 0, "torchrun starts a node's ranks itself"),
        ("", {"DDPACK_STANDBYS": "2"}, ["entrypoint"], 2, "asked for: DDPACK_STANDBYS=2"),
    ],
    ids=["trainer-image", "image-command", "trainer-flags", "no-record", "nproc-per-node", "asked"],
)
def test_a_pyxis_job_reads_what_its_image_runs_from_make_sqshs_record_before_it_starts_a_standby(
    node: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, app_cmd: str | None, env: dict[str, str], command: list[str],
    standbys: int, why: str,
) -> None:  # fmt: skip
    """An image whose own command is not the bundled trainer (its APP_CMD) would take a standby task for a rank, and one
    no record speaks for might: auto starts a standby only where the tasks run the trainer for sure."""
    sqsh = tmp_path / "x.sqsh"
    sqsh.write_bytes(b"hsqs")
    if app_cmd is not None:
        info = sqsh.stat()
        record = {"image": "x:1", "app_cmd": app_cmd, "image_id": "sha256:" + "a" * 64, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
        Path(f"{sqsh}.ddpack.json").write_text(json.dumps(record))
    for name in ("DDPACK_COMMAND", "DDPACK_TRAIN_ARGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DDPACK_SQSH", str(sqsh))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    training = object.__new__(node.Training)
    training.container, training.command, training.now, training.spares = "ddpack-77", command, Facts(0), 0
    chosen, plain = training.choose_recovery(env.get("DDPACK_STANDBYS", "auto"), True)
    assert (chosen.standbys, chosen.why[: len(why)]) == (standbys, why) and plain == chosen  # no spares: the same choice
    sqsh.write_bytes(b"hsqs, changed since make sqsh wrote its record")
    assert training.choose_recovery("auto", True)[0].standbys == (1 if env.get("DDPACK_TRAIN_ARGS") else 0)
