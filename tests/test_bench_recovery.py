"""The benchmarks' recovery measurement (bench/recovery_timing.py) and the two benchmarks that use it, on small
recorded jobs replayed at their recorded times.

Each recording is rank 0's metrics records and the job log's lines, shaped after the test cluster's pyxis jobs (4
ranks on 2 nodes, --snapshot-every 20), each line with its time in seconds after the failure. A replay writes a line
into its file once a fake clock passes its time (a `start` record with the record after it, as the trainer's
MetricsFile.opening writes it), so a benchmark polling the files sees what it would have seen on the cluster: the
failing job's own next progress record milliseconds after the kill, long before the next start trains. That record
is what dc3ebc3's bench_goodput timed (`back 0.0 s`, issue 42); these tests fail on that file.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from testbed.env import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import recovery_timing
from recovery_timing import NO_END, ImplausibleRecovery, LogWatch, Recovery, recovery_from_records

BENCH_GOODPUT = ROOT / "bench" / "bench_goodput.py"
BENCH_RECOVERY = ROOT / "bench" / "bench_recovery.py"
KILLED = 1_764_070_000.0  # the failure, wall clock


@functools.cache
def load(path: Path) -> ModuleType:
    """A benchmark script as a module (bench/ is not a package), once a session."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# Before the failure, the same on every path: a start, steps 1 to 32 (a few shown), a snapshot at step 20.
BEFORE_METRICS = """
-4.10 {"kind": "start", "world_size": 4, "global_step": 0, "total_steps": 768, "slurm_restart_count": 0}
-4.00 {"kind": "progress", "epoch": 0, "step": 1, "global_step": 1, "loss": 2.31}
-1.62 {"kind": "progress", "epoch": 0, "step": 20, "global_step": 20, "loss": 1.92}
-1.55 {"kind": "snapshot", "global_step": 20, "path": "snapshots/step-20", "stall_s": 0.004, "write_s": 0.05}
-0.24 {"kind": "progress", "epoch": 0, "step": 31, "global_step": 31, "loss": 1.71}
-0.12 {"kind": "progress", "epoch": 0, "step": 32, "global_step": 32, "loss": 1.70}
"""
BEFORE_LOG = """
-4.30 ddpack: job 7 (restart 0) on ddnode[1-2], run dir /fsx/rq/runs/requeue-7 (new run)
-4.00 [rank 0/4] epoch 1/3 step 1/256 (global 1/768) loss 2.3100
-1.62 [rank 0/4] epoch 1/3 step 20/256 (global 20/768) loss 1.9200
-0.24 [rank 0/4] epoch 1/3 step 31/256 (global 31/768) loss 1.7100
-0.12 [rank 0/4] epoch 1/3 step 32/256 (global 32/768) loss 1.7000
"""
# Rank 3 SIGKILLed at 0: rank 0 still finishes its step (the record the old bench took), then its collective fails.
KILLED_RANK_METRICS = """
+0.04 {"kind": "progress", "epoch": 0, "step": 33, "global_step": 33, "loss": 1.69}
+0.07 {"kind": "end", "rank": 0, "world_size": 4, "host": "ddnode1", "outcome": "failed", "exit_code": 1, "global_step": 33, "reason": "peer gone"}
"""
KILLED_RANK_LOG = """
+0.04 [rank 0/4] epoch 1/3 step 33/256 (global 33/768) loss 1.6900
+0.07 [rank 0/4] ddpack-end {"rank":0,"world_size":4,"host":"ddnode1","outcome":"failed","exit_code":1}
"""


@dataclass(frozen=True)
class Recording:
    name: str
    metrics: str
    log: str
    back_s: float  # the next start's first progress record
    detect_s: float | None  # the failing segment's end record
    log_back_s: float  # the restart's first progress line


IN_PLACE = Recording(
    "restart in place",
    BEFORE_METRICS
    + KILLED_RANK_METRICS
    + """
+3.40 {"kind": "start", "world_size": 4, "global_step": 20, "total_steps": 768, "slurm_restart_count": 0}
+5.80 {"kind": "progress", "epoch": 0, "step": 21, "global_step": 21, "loss": 1.91}
+5.92 {"kind": "progress", "epoch": 0, "step": 22, "global_step": 22, "loss": 1.90}
""",
    BEFORE_LOG
    + KILLED_RANK_LOG
    + """
+0.90 ddpack: the step failed (exit 1); restarting it in this allocation on ddnode[1-2] from its last snapshot (failure restart 1 of at most 1)
+3.30 [rank 0/4] resuming from snapshots/step-20 at global step 20
+5.81 [rank 0/4] epoch 1/3 step 21/256 (global 21/768) loss 1.9100
+5.93 [rank 0/4] epoch 1/3 step 22/256 (global 22/768) loss 1.9000
""",
    back_s=5.80,
    detect_s=0.07,
    log_back_s=5.81,
)
REQUEUE = Recording(
    "requeue",
    BEFORE_METRICS
    + KILLED_RANK_METRICS
    + """
+27.00 {"kind": "start", "world_size": 4, "global_step": 20, "total_steps": 768, "slurm_restart_count": 1}
+29.30 {"kind": "progress", "epoch": 0, "step": 21, "global_step": 21, "loss": 1.91}
+29.42 {"kind": "progress", "epoch": 0, "step": 22, "global_step": 22, "loss": 1.90}
""",
    BEFORE_LOG
    + KILLED_RANK_LOG
    + """
+1.20 ddpack: the step failed (exit 1); DDPACK_RESTART_IN_PLACE=0: requeueing job 7 to resume from its last snapshot (failure restart 1 of at most 1)
+14.00 ddpack: job 7 (restart 1) on ddnode[1-2], run dir /fsx/rq/runs/requeue-7 (continued)
+26.90 [rank 0/4] resuming from snapshots/step-20 at global step 20
+29.31 [rank 0/4] epoch 1/3 step 21/256 (global 21/768) loss 1.9100
+29.43 [rank 0/4] epoch 1/3 step 22/256 (global 22/768) loss 1.9000
""",
    back_s=29.30,
    detect_s=0.07,
    log_back_s=29.31,
)
# bench_recovery's lost node: Slurm SIGKILLs the whole step with the node, rank 0 too: no next record, no end record.
LOST_NODE = Recording(
    "rank 0 killed with its node",
    BEFORE_METRICS
    + """
+6.00 {"kind": "start", "world_size": 4, "global_step": 20, "total_steps": 768, "slurm_restart_count": 0}
+8.40 {"kind": "progress", "epoch": 0, "step": 21, "global_step": 21, "loss": 1.91}
""",
    BEFORE_LOG
    + """
+2.10 ddpack: the step ended (exit 137) when the job lost ddnode2; restarting it in this allocation on ddnode[1,3] from its last snapshot
+8.41 [rank 0/4] epoch 1/3 step 21/256 (global 21/768) loss 1.9100
""",
    back_s=8.40,
    detect_s=None,
    log_back_s=8.41,
)
RECORDINGS = [IN_PLACE, REQUEUE, LOST_NODE]


def timed(text: str) -> list[tuple[float, str]]:
    """`+S line` rows: (wall-clock time, line)."""
    rows = [line.split(" ", 1) for line in text.splitlines() if line.strip()]
    return [(KILLED + float(at), rest) for at, rest in rows]


def records(recording: Recording, until: float = math.inf) -> list[dict]:
    return [{**json.loads(rest), "time": at} for at, rest in timed(recording.metrics) if at <= until]


class Replay:
    """A recording played back by a fake clock that stands in for the `time` module of the code under test: each
    line shows in its file once the clock has passed its time."""

    def __init__(self, recording: Recording, folder: Path) -> None:
        self.metrics, self.log = folder / "runs" / "job-7" / "metrics.jsonl", folder / "logs" / "job-7.out"
        self.metrics.parent.mkdir(parents=True)
        self.log.parent.mkdir(parents=True)
        rows = records(recording)
        # MetricsFile.opening: a start record is stamped when training begins, written with the next record.
        self.lines = [(r, rows[i + 1]["time"] if r["kind"] == "start" and i + 1 < len(rows) else r["time"]) for i, r in enumerate(rows)]
        self.log_lines = timed(recording.log)
        self.now = KILLED - 60

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.at(self.now + seconds)

    def at(self, now: float) -> None:
        self.now = now
        self.metrics.write_text("".join(json.dumps(r) + "\n" for r, shown in self.lines if shown <= now))
        self.log.write_text("".join(line + "\n" for at, line in self.log_lines if at <= now))


def figures(result: Recovery | dict) -> dict:
    """A recovery's figures by name (dc3ebc3's bench_goodput returned a dict: the proof that these tests catch
    its bug runs them against that file)."""
    return result if isinstance(result, dict) else vars(result)


# --------------------------------------------------------------------------- the measurement


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda r: r.name)
def test_back_is_the_next_starts_first_progress_record_not_the_failing_jobs_own_next_one(recording: Recording) -> None:
    found = recovery_from_records(records(recording), KILLED)
    assert found is not None
    assert found.back_s == pytest.approx(recording.back_s, abs=1e-3)
    assert found.resumed_at == 21 and found.replayed == (33 if recording.detect_s else 32) - 20
    if recording.detect_s is None:
        assert found.detect_s is None
    else:
        assert found.detect_s == pytest.approx(recording.detect_s, abs=1e-3) and found.ended == "failed (exit 1)"
    for seconds in (found.back_s, found.detect_s):
        assert seconds is None or (math.isfinite(seconds) and seconds > 0)


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda r: r.name)
def test_nothing_is_measured_until_the_next_start_has_trained(recording: Recording) -> None:
    """Up to just before the next start's first progress record the job has not trained again, whatever the
    failing job wrote after the kill (its own next progress record, its end record)."""
    assert recovery_from_records(records(recording, until=KILLED + recording.back_s - 0.01), KILLED) is None


def test_a_rank_0_killed_with_its_node_leaves_no_end_record_and_the_measurement_says_why() -> None:
    found = recovery_from_records(records(LOST_NODE), KILLED)
    assert found.detect_s is None and found.ended == NO_END
    told = recovery_from_records(records(LOST_NODE), KILLED, no_end="no end record: the node set DOWN")
    assert told.detect_s is None and told.ended == "no end record: the node set DOWN"


def moved(recording: Recording, which: Callable[[dict], bool], to: float) -> list[dict]:
    """The recording's records with the one `which` picks moved to `to` seconds after the kill."""
    return [{**r, "time": KILLED + to} if which(r) else r for r in records(recording)]


def restart_first(r: dict) -> bool:
    return r["kind"] == "progress" and r["global_step"] == 21 and r["time"] > KILLED


def end(r: dict) -> bool:
    return r["kind"] == "end"


@pytest.mark.parametrize(
    "rows",
    [
        moved(IN_PLACE, restart_first, 0.0),  # the next start's first progress record at the kill itself
        moved(IN_PLACE, restart_first, math.nan),  # a time that is not a number
        moved(IN_PLACE, end, -0.5),  # an end record before the kill (another node's clock)
        moved(REQUEUE, end, 40.0),  # an end record after the next start trained: not the failing segment's
    ],
    ids=["zero", "nan", "negative", "detect-after-back"],
)
def test_a_figure_that_is_zero_negative_or_not_a_number_is_refused(rows: list[dict]) -> None:
    with pytest.raises(ImplausibleRecovery):
        recovery_from_records(rows, KILLED)


def test_the_log_is_timed_from_the_decision_on_and_only_after_the_failure() -> None:
    before = "[rank 0/4] epoch 1/3 step 32/256 (global 32/768) loss 1.7\n"
    watch = LogWatch(skip=len(before))
    text = before + "[rank 0/4] epoch 1/3 step 33/256 (global 33/768) loss 1.69\n"
    watch.see(text, 1.0)
    assert watch.decided_at is None and watch.back_at is None  # the failing job's own next line
    text += "ddpack: the step failed (exit 1); restarting it in this allocation on ddnode[1-2] from its last snapshot\n"
    watch.see(text, 2.0)
    assert watch.decided_at == 2.0 and watch.back_at is None
    watch.see(text + "[rank 0/4] epoch 1/3 step 21/256 (global 21/768) loss 1.91\n", 6.0)
    assert watch.decided_at == 2.0 and watch.back_at == 6.0


# --------------------------------------------------------------------------- the benchmarks, on a replayed cluster


class FakeCluster:
    """bench_goodput's cluster calls answered from a replay: the job starts, trains until the recorded kill, the
    bench kills rank 3, and the files grow at their recorded times while the bench polls them."""

    def __init__(self, recording: Recording, folder: Path) -> None:
        self.replay, self.killed = Replay(recording, folder), []

    def submit(
        self, folder: Path, name: str, sbatch_args: tuple[str, ...] = (), template: str = "", **settings: str
    ) -> tuple[str, Path, Path]:
        self.replay.at(KILLED - 10)
        return "7", self.replay.metrics, self.replay.log

    def wait_for_progress(self, metrics: Path, count: int, log: Path, what: str = "", timeout: float = 300) -> None:
        self.replay.at(KILLED)  # trained until the kill the recording was made with

    def signal_tasks(self, job: str, node: str, sig: int, rank: int | None = None) -> list[int]:
        self.killed.append((job, node, sig, rank, self.replay.now))
        return [4242]

    def wait_for_end(self, job: str, log: Path, timeout: float = 480) -> tuple[str, int]:
        return "CANCELLED", 0


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def play(module: ModuleType, recording: Recording) -> FakeCluster:
        cluster = FakeCluster(recording, tmp_path)
        for name in ("submit", "wait_for_progress", "signal_tasks", "wait_for_end"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(cluster, name))
        monkeypatch.setattr(module, "time", cluster.replay)
        monkeypatch.setattr(recovery_timing, "time", cluster.replay)
        monkeypatch.setattr(module, "subprocess", SimpleNamespace(run=lambda *a, **k: subprocess.CompletedProcess(a, 0, "", "")))
        return cluster

    return play


@pytest.mark.parametrize("recording, in_place", [(REQUEUE, False), (IN_PLACE, True)], ids=["requeue", "in-place"])
def test_bench_goodput_times_the_restart_not_the_failing_jobs_next_record(
    replayed, tmp_path: Path, recording: Recording, in_place: bool
) -> None:
    """The figures `make bench-goodput` prints and feeds the model: back and detect from the records, and back again
    from the log, agreeing (dc3ebc3's printed back 0.0 s, detect NaN)."""
    bench = load(BENCH_GOODPUT)
    cluster = replayed(bench, recording)
    result = figures(bench.recovery(tmp_path / "job", tmp_path / "image.sqsh", tmp_path, in_place, "job"))
    assert [k[:4] for k in cluster.killed] == [("7", "ddnode2", 9, 3)]
    for name in ("back_s", "detect_s"):
        assert math.isfinite(result[name]) and result[name] > 0, (name, result)
    assert result["back_s"] == pytest.approx(recording.back_s, abs=1e-3)
    assert result["detect_s"] == pytest.approx(recording.detect_s, abs=1e-3)
    assert result["log_back_s"] == pytest.approx(recording.log_back_s, abs=2 * recovery_timing.POLL_S)
    assert result["decided_s"] < result["back_s"]


def test_bench_recovery_times_a_lost_node_without_an_end_record(replayed, tmp_path: Path) -> None:
    bench = load(BENCH_RECOVERY)
    cluster = replayed(bench, LOST_NODE)
    cluster.replay.at(KILLED)
    reason = "no end record: the node set DOWN made Slurm SIGKILL the step, rank 0 with it"
    row = bench.measure("in place", "lost node", lambda: None, "7", cluster.replay.metrics, cluster.replay.log, no_end=reason)
    r = row.recovery
    assert r.back_s == pytest.approx(LOST_NODE.back_s, abs=1e-3) and r.detect_s is None and r.ended == reason
    assert r.log_back_s == pytest.approx(LOST_NODE.log_back_s, abs=2 * recovery_timing.POLL_S) and r.log_agrees
    assert r.replayed == 12 and row.lost_s == pytest.approx(r.back_s + 12 * 0.12, abs=1e-3)  # steps 21-32 again, 0.12 s each


def test_the_model_is_fed_the_figures_measured_and_refuses_a_requeue_faster_than_a_restart() -> None:
    """The model's requeue wait is the requeue's back less the restart's and an unpack; dc3ebc3 fed it 0.0 s.
    Swapped, the two recoveries give a negative wait: refused, not clamped to zero."""
    bench = load(BENCH_GOODPUT)
    requeue, in_place = recovery_from_records(records(REQUEUE), KILLED), recovery_from_records(records(IN_PLACE), KILLED)
    site = bench.measured_site(fsx_mbps=1200, size_mb=1228, sbcast_mbps=[154.0], unpack_mbps=951, requeue=requeue, in_place=in_place)
    assert site.requeue_s == pytest.approx(29.30 - 5.80 - 1228 / 951, abs=1e-3)
    assert site.detect_s == pytest.approx(0.07, abs=1e-3) and site.trainer_s == pytest.approx(5.80 - 0.07 - site.step_s, abs=1e-3)
    with pytest.raises(ImplausibleRecovery, match="requeue's wait"):
        bench.measured_site(fsx_mbps=1200, size_mb=1228, sbcast_mbps=[154.0], unpack_mbps=951, requeue=in_place, in_place=requeue)


def progress(step: int, at: float) -> dict:
    return {"kind": "progress", "global_step": step, "time": at}


@pytest.mark.parametrize("path", ["restart", "in-process"])
def test_bench_restart_times_training_again_not_a_survivors_step_logged_just_after_the_kill(path: str) -> None:
    """`bench_restart --standbys` round 3 once printed today's restart `back 0.003`: rank 0 logged a step whose
    collective completed just before the kill, 3 ms after it. Training again begins at the new start (today's
    restart) or the recovery record (in process), and the step it must pass is the one the old segment reached."""
    training_again = load(ROOT / "bench" / "bench_restart.py").training_again
    killed = 100.0
    before = [progress(step, killed - 0.5 + step / 100) for step in range(35, 41)]
    survivor = progress(41, killed + 0.003)  # its all-reduce completed before the kill
    if path == "restart":
        boundary = [{"kind": "end", "time": killed + 0.2}, {"kind": "start", "global_step": 40, "time": killed + 7.0}]
        again = [progress(41, killed + 7.4), progress(42, killed + 7.45)]
    else:
        boundary = [{"kind": "recovery", "time": killed + 0.42}]
        again = [progress(42, killed + 0.42), progress(43, killed + 0.45)]
    records = [*before, survivor, *boundary]
    assert training_again(records, killed) is None  # nothing trained again yet: the bench keeps waiting
    back, past, reached, after = training_again([*records, *again], killed)
    assert reached == 41 and back == again[0] and past == next(r for r in again if r["global_step"] > 41)
    assert after[0] == boundary[-1]  # the new start, or the recovery record
