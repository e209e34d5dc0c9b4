"""Real DDP jobs on this machine (gloo): convergence, agreement, preemption, exact resume, failures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ddp_jobs import metrics_step, reference_checksum, start_slurm_step, start_standalone, stopped_mid_epoch_then_resumed, subdir, wait_for

from train.affinity import cpu_list

pytestmark = pytest.mark.dist

# 16384 samples (90% for training) / (2 ranks x 32) = 231 steps an epoch: a signal after step 30 lands mid-epoch.
LONG = ["--dataset-size", "16384", "--epochs", "2", "--batch-size", "32", "--log-every", "1"]


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"progress"' in line]


def test_two_ranks_slurm_step_learn_and_agree(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    job = start_slurm_step(tmp_path, [2], ["--epochs", "4", "--snapshot-dir", "", "--metrics-file", str(metrics)])
    assert job.wait() == [0, 0], job.output()
    out = job.output()
    assert "[rank 1/2] start: rank 1 world 2 local_rank 1/2 backend gloo device cpu" in out
    assert "checksums agree across 2 ranks" in out
    assert len(set(job.checksums())) == 1 and len(job.checksums()) == 2
    # Each rank's end record is its last line; rank 0's is the metrics file's last record too.
    ends = [job.ends(rank)[-1] for rank in range(2)]
    assert [(e.rank, e.outcome, e.exit_code, e.global_step == e.total_steps) for e in ends] == [(0, "done", 0, True), (1, "done", 0, True)]
    assert job.output(1).rstrip().splitlines()[-1].startswith("[rank 1/2] ddpack-end {")
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["kind"] == "end" and last["checksum"] == ends[1].checksum and last["final_loss"] == ends[0].final_loss
    seen = losses(metrics)
    assert seen[-1] < seen[0] * 0.5, seen
    evals = [json.loads(line) for line in metrics.read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["eval_mse"] < evals[0]["eval_mse"]
    assert re.search(r"samples/s [\d,]+ mfu [\d.]+% eta \d+:\d\d:\d\d", out)


def test_four_ranks_on_two_simulated_nodes_classification(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    args = ["--task", "classification", "--epochs", "3", "--batch-size", "64", "--snapshot-dir", "", "--metrics-file", str(metrics)]
    job = start_slurm_step(tmp_path, [2, 2], args)
    assert job.wait() == [0] * 4, job.output()
    assert len(job.checksums()) == 4 and len(set(job.checksums())) == 1
    assert "[rank 3/4] start: rank 3 world 4 local_rank 1/2" in job.output()
    accuracy = [json.loads(line)["eval_accuracy"] for line in metrics.read_text().splitlines() if '"eval"' in line]
    assert accuracy[-1] > 0.5, accuracy  # ten classes: chance is 0.1


def test_torchrun_two_processes_via_entrypoint(tmp_path: Path) -> None:
    job = start_standalone(tmp_path, 2, ["--epochs", "3", "--snapshot-dir", ""])
    assert job.wait() == [0], job.output()
    assert len(job.checksums()) == 2 and len(set(job.checksums())) == 1


def test_torchrun_per_node_shape_under_slurm_four_ranks(tmp_path: Path) -> None:
    """One Slurm task per node, each a torchrun agent with 2 local ranks, c10d rendezvous on the job id."""
    job = start_slurm_step(tmp_path, [1, 1], ["--epochs", "2", "--snapshot-dir", ""], nproc_per_node=2)
    assert job.wait() == [0, 0], job.output()
    assert len(job.checksums()) == 4 and len(set(job.checksums())) == 1
    assert "checksums agree across 4 ranks" in job.output()


def test_sigterm_to_one_rank_stops_all_and_resume_is_bit_exact(tmp_path: Path) -> None:
    """Only rank 1 hears it, as when one node is preempted; the helper checks the stop lands mid-epoch with
    its snapshot and the rerun resumes at that position."""
    expected = reference_checksum(tmp_path, LONG)
    stopped, resumed = stopped_mid_epoch_then_resumed(tmp_path, LONG, after_step=30)
    out = stopped.output()
    assert "[rank 1/2] stopped on SIGTERM (received here) at epoch 1/2 step" in out
    assert "[rank 0/2] stopped on SIGTERM (received by another rank)" in out
    assert "resumed after epoch 1/2 step" in resumed.output()
    assert set(resumed.checksums()) == {expected}


def test_sigusr1_stops_with_snapshot_and_exit_code_138(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    job = start_slurm_step(tmp_path, [2], [*LONG, "--snapshot-dir", str(tmp_path / "snap"), "--metrics-file", str(metrics)])
    wait_for(lambda: metrics_step(metrics) >= 10, 60, "step 10")
    job.send(signal.SIGUSR1, [0])
    assert job.wait() == [138, 138], job.output()
    assert "[rank 0/2] stopped on SIGUSR1 (received here)" in job.output()
    assert "[rank 1/2] stopped on SIGUSR1 (received by another rank)" in job.output()
    assert list((tmp_path / "snap").glob("snapshot-*.pt"))


def test_sigkill_then_resume_from_last_snapshot_is_bit_exact(tmp_path: Path) -> None:
    expected = reference_checksum(tmp_path, LONG)
    snap = tmp_path / "snap"
    args = [*LONG, "--snapshot-dir", str(snap), "--snapshot-every", "20"]
    job = start_slurm_step(subdir(tmp_path, "killed"), [2], args)
    wait_for(lambda: any(p.name >= "snapshot-0000000060.pt" for p in snap.glob("snapshot-*.pt")), 60, "a snapshot at step 60")
    job.kill(signal.SIGKILL)
    resumed = start_slurm_step(subdir(tmp_path, "resumed"), [2], args)
    assert resumed.wait() == [0, 0], resumed.output()
    assert "resuming from" in resumed.output()
    assert set(resumed.checksums()) == {expected}


def test_truncated_snapshot_is_reported_skipped_and_kept(tmp_path: Path) -> None:
    args = ["--epochs", "3", "--snapshot-every", "40"]
    expected = reference_checksum(tmp_path, args)
    snap = tmp_path / "snap"
    first = start_slurm_step(subdir(tmp_path, "first"), [2], [*args, "--snapshot-dir", str(snap)])
    assert first.wait() == [0, 0], first.output()
    newest, previous = sorted(snap.glob("snapshot-*.pt"), reverse=True)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    again = start_slurm_step(subdir(tmp_path, "again"), [2], [*args, "--snapshot-dir", str(snap)])
    assert again.wait() == [0, 0], again.output()
    out = again.output()
    assert f"snapshot {newest} is unreadable" in out and "skipping it (left in place)" in out
    assert f"resuming from {previous}" in out
    assert set(again.checksums()) == {expected}
    aside = newest.with_name(newest.name + ".unreadable")
    assert aside.exists() and aside.stat().st_size == len(data) // 2


def running_pair(tmp_path: Path, timeout_s: int):
    """Two ranks with a short collective timeout, past their fifth step."""
    metrics = tmp_path / "m.jsonl"
    args = [*LONG, "--snapshot-dir", "", "--collective-timeout", str(timeout_s), "--metrics-file", str(metrics)]
    job = start_slurm_step(tmp_path, [2], args)
    wait_for(lambda: metrics_step(metrics) >= 5, 60, "step 5")
    return job


def test_killed_peer_ends_the_survivor_within_the_timeout(tmp_path: Path) -> None:
    job = running_pair(tmp_path, 10)
    job.send(signal.SIGKILL, [1])
    code = job.procs[0].wait(timeout=60)  # a survivor left waiting would outlive this
    assert code == 1
    assert "a collective failed" in job.output(0) and "a peer died or did not answer within --collective-timeout=10s" in job.output(0)
    end = job.ends(0)[-1]
    assert end.outcome == "failed" and end.exit_code == 1 and "a collective failed" in end.reason and end.global_step >= 5


@contextlib.contextmanager
def full_disk(folder: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs at `folder`, filled: a run folder on a full disk (--metrics-file refuses a device such as /dev/full,
    which is no file a run could have). Root mounts it, as CI runs; elsewhere a skip, under CI a failure."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "ddpack-full", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to mount a tmpfs: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_run_folder_ends_every_rank_at_once_with_an_end_record(tmp_path: Path) -> None:
    """The metrics file on a full disk: rank 0 ends as failed with one line naming the file, and its peer, left in the
    next collective, ends within seconds, not the collective timeout (300 s here)."""
    with full_disk(tmp_path / "full") as full:
        metrics = full / "metrics.jsonl"
        args = [*LONG, "--snapshot-dir", "", "--metrics-file", str(metrics), "--collective-timeout", "300"]
        job = start_slurm_step(tmp_path, [2], args)
        assert [job.procs[rank].wait(timeout=120) for rank in range(2)] == [1, 1], job.output()
    out = job.output(0)
    assert f"error: the start record could not be written to {metrics}: [Errno 28] No space left on device" in out and "Traceback" not in out
    end = job.ends(0)[-1]
    assert end.outcome == "failed" and str(metrics) in end.reason and job.ends(1)[-1].outcome == "failed"
    assert f"warning: the end record could not be written to {metrics}" in out


def test_a_stopped_rank_is_named_by_the_hang_watchdog_which_ends_the_job_with_evidence(tmp_path: Path) -> None:
    """SIGSTOP (a frozen node): the stopped rank cannot write its own stacks; rank 0 notices that no rank
    finishes a step, writes its stacks and a summary naming the rank whose heartbeat went stale, and
    exits 124 well before the collective timeout. A snapshot every step: rank 0 may be left waiting in
    the snapshot's gather too, which must count as a wait (it once counted as progress)."""
    forensics = tmp_path / "forensics"
    metrics = tmp_path / "m.jsonl"
    args = [*LONG, "--snapshot-dir", str(tmp_path / "snapshots"), "--snapshot-every", "1", "--collective-timeout", "120"]
    args += ["--hang-timeout", "5", "--forensics-dir", str(forensics)]
    args += ["--metrics-file", str(metrics)]
    job = start_slurm_step(tmp_path, [2], args)
    wait_for(lambda: metrics_step(metrics) >= 5, 60, "step 5")
    job.send(signal.SIGSTOP, [1])
    started = time.monotonic()
    try:
        code = job.procs[0].wait(timeout=60)
    finally:
        job.send(signal.SIGKILL, [1])
    # Not before the hang timeout; ended by the watchdog (124, its summary), not the collective timeout (120 s, exit 1).
    assert code == 124 and time.monotonic() - started >= 5, job.output()
    summary = json.loads((forensics / "summary.json").read_text())
    assert summary["behind_ranks"] == [1] and "no heartbeat" in summary["behind"][0], summary
    assert sorted(p.name for p in forensics.glob("rank-*.txt")) == ["rank-0.txt"]
    # Rank 0 waits in one of a step's collectives: the gradients', the metrics', the snapshot's or the stop agreement's.
    assert re.search(r"in (sync|metrics|snapshot-gather|step-end) for ", (forensics / "rank-0.txt").read_text().splitlines()[0])
    assert f"evidence in {forensics}" in job.output(0)
    end = json.loads(metrics.read_text().splitlines()[-1])  # rank 0's end record, from the watchdog
    assert end["kind"] == "end" and end["outcome"] == "hung" and end["exit_code"] == 124 and end["forensics"] == str(forensics)
    assert "behind: rank 1 " in end["reason"] and job.ends(0)[-1].outcome == "hung"


def test_a_rank_stuck_in_its_dataset_ends_every_rank_with_its_stack_frame_in_the_forensics(tmp_path: Path) -> None:
    """The issue's case: rank 1 blocks forever inside a user's dataset (in a DataLoader worker). Both
    ranks end with 124; the summary names rank 1 (in `data` while rank 0 waits in the gradient sync),
    and rank 1's file holds the worker's frame where it blocked. The blocked worker ends with its rank
    (it would otherwise wait forever, orphaned)."""
    forensics = tmp_path / "forensics"
    args = ["--task", "plugins.hang_task:make", "--epochs", "3", "--batch-size", "16", "--log-every", "1", "--snapshot-dir", ""]
    args += ["--hang-timeout", "5", "--forensics-dir", str(forensics), "--num-workers", "1"]
    job = start_slurm_step(tmp_path, [2], args, cwd=USER_DIR, rank_env={r: {"HANG_TASK_RANK": "1"} for r in range(2)})
    assert job.wait(timeout=90) == [124, 124], job.output()
    summary = json.loads((forensics / "summary.json").read_text())
    assert summary["behind_ranks"] == [1] and " in data after step " in summary["behind"][0], summary
    assert {r["phase"] for r in summary["ranks"].values()} == {"data", "sync"}
    stacks = (forensics / "rank-1.txt").read_text()
    assert "DataLoader worker-0" in stacks and re.search(r"hang_task\.py\", line \d+ in wait_for_storage_that_never_answers", stacks), stacks
    for rank in range(2):
        assert "behind: rank 1 on " in job.output(rank) and f"evidence in {forensics}" in job.output(rank), job.output(rank)
    workers = [int(pid) for pid in re.findall(r"--- DataLoader worker-\d+-pid(\d+) ---", stacks)]
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 10, f"rank 1's DataLoader workers {workers} to end")


# ---------------------------------------------------------------- DataLoader workers, torchrun stops

# A dataset with random augmentation through DataLoader workers: 4096 samples / (2 x 16) = 128 steps an epoch.
# The jobs run in tests/, where the user's module lives (`--task` imports from the working directory).
USER_DIR = Path(__file__).resolve().parent
WORKERS = ["--task", "plugins.augmented_task:make", "--epochs", "2", "--batch-size", "16", "--log-every", "1"]


def test_sigterm_mid_epoch_with_dataloader_workers_resumes_bit_exact(tmp_path: Path) -> None:
    expected = reference_checksum(tmp_path, [*WORKERS, "--num-workers", "2"], cwd=USER_DIR)
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    args = [*WORKERS, "--num-workers", "2", "--snapshot-dir", str(snap), "--snapshot-every", "1000", "--metrics-file", str(metrics)]
    job = start_slurm_step(tmp_path, [2], args, cwd=USER_DIR)
    wait_for(lambda: metrics_step(metrics) >= 20, 90, "step 20")
    job.send(signal.SIGTERM, [0])
    assert job.wait() == [143, 143], job.output()
    stopped = job.ends(0)[-1]
    assert stopped.outcome == "stopped" and 0 < stopped.step_in_epoch < stopped.steps_per_epoch, "the stop must land mid-epoch"
    # Resumed with another worker count: each batch's augmentation is seeded by its position, not its worker.
    resumed = start_slurm_step(subdir(tmp_path, "resume"), [2], [*args[:-2], "--num-workers", "1", "--metrics-file", str(metrics)], cwd=USER_DIR)
    assert resumed.wait() == [0, 0], resumed.output()
    assert f"resumed after epoch 1/2 step {stopped.step_in_epoch}/{stopped.steps_per_epoch}" in resumed.output()
    assert set(resumed.checksums()) == {expected}


def test_workers_and_no_workers_see_the_same_samples(tmp_path: Path) -> None:
    with_workers = reference_checksum(subdir(tmp_path, "w2"), [*WORKERS, "--num-workers", "2", "--max-steps", "40"], cwd=USER_DIR)
    inline = reference_checksum(subdir(tmp_path, "w0"), [*WORKERS, "--num-workers", "0", "--max-steps", "40"], cwd=USER_DIR)
    assert with_workers == inline


def test_torchrun_shape_stops_on_sigterm_like_the_other_shapes_and_resumes(tmp_path: Path) -> None:
    snap, metrics = tmp_path / "snap", tmp_path / "m.jsonl"
    args = [*LONG, "--snapshot-dir", str(snap), "--snapshot-every", "1000", "--metrics-file", str(metrics)]
    job = start_standalone(tmp_path, 2, args)
    wait_for(lambda: metrics_step(metrics) >= 20, 90, "step 20")
    job.send(signal.SIGTERM, [0])  # the agent, as docker stop and Slurm signal it
    assert job.wait() == [143], job.output()
    out = job.output()
    assert out.count("stopped on SIGTERM") == 2, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert list(snap.glob("snapshot-*.pt"))
    resumed = start_standalone(subdir(tmp_path, "resume"), 2, args)
    assert resumed.wait() == [0], resumed.output()
    assert "resuming from" in resumed.output() and len(set(resumed.checksums())) == 1


# ---------------------------------------------------------------- CPU binding

PROBE = ["--task", "plugins.affinity_task:make", "--max-steps", "3", "--batch-size", "16", "--snapshot-dir", ""]


def probe_threads(tmp: Path, *args: str) -> tuple[dict[int, dict], str]:
    """Two ranks of one Slurm step on this machine run the probe task; what each fetching process's
    threads may run on, by rank, and the job's output."""
    job = start_slurm_step(tmp, [2], [*PROBE, *args], cwd=USER_DIR, rank_env={r: {"AFFINITY_PROBE_DIR": str(tmp)} for r in (0, 1)})
    assert job.wait() == [0, 0], job.output()
    records = [json.loads(path.read_text()) for path in tmp.glob("rank*.json")]
    return {record["rank"]: record for record in records}, job.output()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need a CPU each to be bound")
@pytest.mark.parametrize("workers", [0, 1])
def test_ranks_sharing_the_cpus_bind_to_disjoint_halves_and_their_workers_inherit_them(tmp_path: Path, workers: int) -> None:
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    halves = {0: cpu_list(allowed[: len(allowed) // 2]), 1: cpu_list(allowed[len(allowed) // 2 :])}
    records, out = probe_threads(tmp_path, "--num-workers", str(workers))
    assert sorted(records) == [0, 1] and {r["worker"] for r in records.values()} == {workers > 0}
    for rank, record in records.items():
        # Every thread: the training thread, gloo's (started before the binding) and, with workers, the worker's own.
        assert set(record["threads"].values()) == {halves[rank]}, (rank, record)
        assert re.search(rf"\[rank {rank}/2\] start: .* pid \d+ cpus {halves[rank]}\n", out), out


def test_cpu_bind_none_leaves_every_thread_where_the_os_put_it(tmp_path: Path) -> None:
    everything = cpu_list(tuple(sorted(os.sched_getaffinity(0))))
    records, out = probe_threads(tmp_path, "--num-workers", "0", "--cpu-bind", "none")
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert set(record["threads"].values()) == {everything}, record
    assert " cpus " not in out
