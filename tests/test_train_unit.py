"""The trainer's parts in one process: flags, tasks, snapshot store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from ddp_jobs import run_train

from testbed.env import ROOT, clean_env
from train.affinity import cpu_list, crowding, parse_cpu_list, plan_slices
from train.config import build_parser, parse_config
from train.data import BatchKey, SeededBatches
from train.distributed import DeviceError, choose_cuda_index
from train.metrics import MetricsFile, MetricsWriteError
from train.model import unused_parameter_names
from train.outcome import RunEnd, checksums, read_ends
from train.snapshot import (
    Snapshot,
    SnapshotStore,
    SnapshotsUnreadable,
    SnapshotWriteError,
    SnapshotWriter,
    Written,
    list_snapshots,
    snapshot_name,
)
from train.tasks import TaskError, load_task

REQUIRED_FLAGS = [
    "--epochs",
    "--batch-size",
    "--lr",
    "--seed",
    "--snapshot-dir",
    "--snapshot-every",
    "--log-every",
    "--metrics-file",
    "--grad-accum",
    "--amp",
    "--max-steps",
    "--task",
    "--collective-timeout",
    "--backend",
    "--cpu-bind",
    "--clip-grad-norm",
    "--sync-batchnorm",
    "--find-unused-parameters",
    "--compile",
]


def test_help_documents_every_flag() -> None:
    text = build_parser().format_help()
    for flag in REQUIRED_FLAGS:
        assert flag in text, flag


def test_bad_flag_values_are_rejected_by_name() -> None:
    with pytest.raises(SystemExit):
        parse_config(["--batch-size", "0"])


@pytest.mark.parametrize("variable", ["DDPACK_CPU_BIND", "DDPACK_BACKEND"])
def test_a_bad_setting_from_the_environment_is_one_line_exit_2(variable: str) -> None:
    env = clean_env(PYTHONPATH=str(ROOT), **{variable: "bogus"})
    out = subprocess.run([sys.executable, "-m", "train"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith(f"train: error: {variable}='bogus' is not one of") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        ("DDPACK_TEST_DIE_IN_SYNC", "is not <rank>:<global step>"),
        ("DDPACK_TEST_DIE_IN_PROGRESS", "is not <rank>:<file>"),
        ("DDPACK_TEST_DIE_IN_SNAPSHOT", "is not <rank>:<file>"),
    ],
)
def test_a_bad_tests_only_knob_is_one_line_exit_2_before_training(variable: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The knobs tests/test_recovery_dist.py arms (read under --recovery) are refused as the settings are, by parse_config,
    not as a traceback once the ranks are up."""
    with pytest.raises(SystemExit) as ended, patch.dict(os.environ, {variable: "oops"}):
        parse_config(["--recovery"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train: error: {variable}='oops' {expected}") and err.count("\n") == 1, err
    with patch.dict(os.environ, {variable: "1:12" if variable.endswith("SYNC") else "1:/tmp/die"}):
        assert parse_config(["--recovery"]).recovery  # a good value passes
    with patch.dict(os.environ, {variable: "oops"}):
        assert not parse_config([]).recovery  # and is not read without --recovery


A, B = "boot-a", "boot-b"  # two machines' boot ids


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        # torchrun's or the entrypoint's local ranks: one CPU set, split in rank order
        ([(A, (0, 1, 2, 3)), (A, (0, 1, 2, 3))], [(0, 1), (2, 3)]),
        # uneven: as even as the count allows
        ([(A, (0, 1, 2, 3, 4)), (A, (0, 1, 2, 3, 4))], [(0, 1), (2, 3, 4)]),
        # two machines, two ranks each (ranks 0 and 2 on A): each machine split on its own
        ([(A, (0, 1)), (B, (0, 1)), (A, (0, 1)), (B, (0, 1))], [(0,), (0,), (1,), (1,)]),
        # already bound apart (srun --cpu-bind, cgroups): left alone
        ([(A, (0, 1)), (A, (2, 3))], [None, None]),
        # more ranks than CPUs, or alone: left alone
        ([(A, (0,)), (A, (0,))], [None, None]),
        ([(A, (0, 1, 2))], [None]),
    ],
)
def test_cpu_slices_go_to_ranks_that_share_a_machines_cpus(seen: list, expected: list) -> None:
    assert plan_slices(seen, cores_of=lambda cpus: [(cpu,) for cpu in cpus]) == expected


def test_ranks_that_outnumber_their_machines_cpus_are_crowded_and_their_waits_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test cluster's shape (4 ranks of two nodes on one 2-CPU host, unbound) is crowded for every rank; two ranks
    on two CPUs, ranks bound apart (srun --cpu-bind), a replacement beside bound survivors, or another machine's ranks
    are not. A crowded rank's wait sleeps between polls instead of spinning."""
    from train import distributed

    four = [(A, (0, 1))] * 4
    assert [crowding(four, rank) for rank in range(4)] == ["4 ranks share 2 CPUs on this machine"] * 4
    assert crowding([(A, (0, 1)), (A, (0, 1))], 1) == ""
    assert crowding([(A, (0,)), (A, (1,)), (A, (2, 3))], 0) == ""  # bound apart
    assert crowding([(A, (0,)), (A, (0, 1, 2)), (A, (2,))], 1) == ""  # a replacement beside bound survivors, the slice of 1 free
    assert crowding([(A, (0,)), (B, (0,)), (A, (0,))], 1) == "" and crowding([(A, (0,)), (B, (0,)), (A, (0,))], 0) == "2 ranks share 1 CPU on this machine"
    assert crowding([(A, ()), (A, ())], 0) == ""  # CPUs not known: spin as before

    class Work:
        polls = 0

        def is_completed(self) -> bool:
            self.polls += 1
            return self.polls > 3

        def wait(self) -> None:
            pass

    slept: list[float] = []
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    monkeypatch.setattr(distributed, "crowding", "4 ranks share 2 CPUs on this machine")
    distributed.wait_polling(Work())
    assert slept == [distributed.CROWDED_POLL_S] * 3
    monkeypatch.setattr(distributed, "crowding", "")
    distributed.wait_polling(Work())
    assert len(slept) == 3  # spun (sched_yield), slept no more


def hyperthreaded(cpus: tuple[int, ...]) -> list[tuple[int, ...]]:
    """CPUs 0-7 as 4 cores with 2 hyperthreads each, numbered apart as Linux does: core i is (i, i + 4)."""
    return [tuple(c for c in cpus if c % 4 == core) for core in range(4) if any(c % 4 == core for c in cpus)]


def test_cpu_slices_keep_each_cores_hyperthreads_together() -> None:
    eight = (0, 1, 2, 3, 4, 5, 6, 7)
    assert plan_slices([(A, eight)] * 2, cores_of=hyperthreaded) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    # more ranks than cores but not than CPUs: one CPU each, neighbouring ranks on one core
    assert plan_slices([(A, eight)] * 8, cores_of=hyperthreaded) == [(c,) for c in hyperthreaded(eight) for c in c]


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert cpu_list((5,)) == "5"
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nonsense", "neither a built-in task"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("plugins.user_task:missing", "has no callable 'missing'"),
        ("plugins.user_task:not_a_task", "returned str"),
    ],
)
def test_bad_task_is_one_line_exit_2(spec: str, needle: str) -> None:
    out = run_train("--task", spec)
    assert out.returncode == 2
    assert out.stderr.startswith("train: error: --task") and out.stderr.count("\n") == 1 and needle in out.stderr


def test_user_task_plugs_in_and_learns_without_editing_the_bundle(tmp_path: Path) -> None:
    out = run_train(
        "--task", "plugins.user_task:make", "--epochs", "5", "--snapshot-dir", str(tmp_path / "s"), "--log-every", "8", "--grad-accum", "2"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "task squares" in out.stdout and "checksums agree across 1 ranks" in out.stdout
    losses = [float(line.split(" loss ")[1].split()[0]) for line in out.stdout.splitlines() if " loss " in line]
    assert losses[-1] < losses[0]


def test_rerun_after_completion_is_a_no_op_with_the_same_checksum(tmp_path: Path) -> None:
    args = ("--epochs", "2", "--snapshot-dir", str(tmp_path / "s"))
    first, second = run_train(*args), run_train(*args)
    assert first.returncode == second.returncode == 0
    assert "training already complete at global step" in second.stdout
    checksum = [line for line in first.stdout.splitlines() if "final parameter checksum" in line]
    assert checksum and checksum[0] in second.stdout


def test_builtin_tasks_batch_by_tensor_indexing() -> None:
    task = load_task(parse_config(["--task", "classification", "--dataset-size", "1000"]))
    assert isinstance(task.train_data, torch.utils.data.TensorDataset)
    assert len(task.train_data) == 900 and task.eval_data is not None and len(task.eval_data) == 100
    with pytest.raises(TaskError):
        load_task(parse_config(["--task", "a:b:c:"]))


def _state(step: int) -> Snapshot:
    return Snapshot(
        model={"w": torch.full((3,), float(step))}, optimizer={}, epoch=0, step_in_epoch=step, global_step=step, rng=[], world_size=1, config={}
    )


def test_store_keeps_newest_readable_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(_state(step))
    assert [p.name for p in list_snapshots(tmp_path)] == [snapshot_name(30), snapshot_name(20)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot_name(20), snapshot_name(30)]
    state, path, reports = SnapshotStore(tmp_path).load_latest()
    assert path == tmp_path / snapshot_name(30) and state.model["w"][0] == 30 and reports == []


class GatedStore(SnapshotStore):
    """A store whose writes wait for the test's go-ahead, so a write can be caught in flight."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, keep=5)
        self.gate = threading.Event()
        self.fail = False

    def save(self, state: Snapshot) -> Path:
        assert self.gate.wait(30)
        if self.fail:
            raise OSError(28, "No space left on device")
        return super().save(state)


def test_background_snapshots_hold_training_only_for_the_copy_one_write_at_a_time(tmp_path: Path) -> None:
    store, written = GatedStore(tmp_path), []
    writer = SnapshotWriter(store, written.append)
    state = _state(10)
    writer.submit(state, held_since=0.0)
    assert writer.in_flight and list_snapshots(tmp_path) == []  # training goes on while it writes
    state.model["w"].fill_(99.0)  # training changes the live tensors at once
    store.gate.set()
    last = writer.wait()
    assert isinstance(last, Written) and written == [last] and last.global_step == 10 and last.write_s >= 0
    assert torch.load(last.path, weights_only=True)["model"]["w"].tolist() == [10.0] * 3  # the copy, not the live tensor
    store.gate.clear()
    writer.submit(_state(20), held_since=0.0)
    submitted = threading.Event()
    second = threading.Thread(target=lambda: (writer.submit(_state(30), held_since=0.0), submitted.set()))
    second.start()
    assert not submitted.wait(0.5)  # at most one write in flight: the next submit waits for it
    store.gate.set()
    second.join(30)
    assert writer.wait().global_step == 30 and [w.global_step for w in written] == [10, 20, 30]


def test_a_failed_background_write_is_raised_at_the_next_wait_and_leaves_the_last_snapshot(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    store.gate.set()
    writer = SnapshotWriter(store, lambda _: None)
    writer.submit(_state(10), held_since=0.0)
    writer.wait()
    store.fail = True
    writer.submit(_state(20), held_since=0.0)
    with pytest.raises(SnapshotWriteError, match=r"step 20 could not be written to .*: \[Errno 28\] No space left on device; make room or fix its permissions"):
        writer.wait()
    assert [p.name for p in list_snapshots(tmp_path)] == [snapshot_name(10)]
    assert writer.wait().global_step == 10  # reported once; the last durable snapshot stays known


@pytest.mark.parametrize("kind", ["/dev/zero", "/dev/full", "fifo", "directory", "link to /dev/zero"])
def test_a_metrics_file_that_is_not_a_regular_file_is_refused_in_one_line_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Rank 0 reads its metrics file back on a resume: /dev/zero (or /dev/full) would feed it zeros until the OOM
    killer ends it, a FIFO would block its first record. Refused at set-up, on every rank, exit 2, from the flag or
    from the template's DDPACK_METRICS_FILE; a regular file, or none there yet, is taken."""
    path = {"fifo": tmp_path / "metrics.fifo", "directory": tmp_path, "link to /dev/zero": tmp_path / "m.jsonl"}.get(kind, Path(kind))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    what = {"fifo": "a FIFO (a named pipe)", "directory": "a directory"}.get(kind, "a character device")
    for argv in (["--metrics-file", str(path)], []):
        monkeypatch.setenv("DDPACK_METRICS_FILE", str(path))
        with pytest.raises(SystemExit) as ended:
            parse_config(argv)
        err = capsys.readouterr().err
        assert ended.value.code == 2 and err.startswith(f"train: error: --metrics-file {path} is {what}, not a file:") and err.count("\n") == 1
    for fine in (tmp_path / "new" / "metrics.jsonl", tmp_path / "kept.jsonl"):
        (tmp_path / "kept.jsonl").write_text("")
        assert parse_config(["--metrics-file", str(fine)]).metrics_file == str(fine)


def test_a_metrics_file_on_a_full_disk_is_one_error_naming_it_and_the_next_record_is_tried_afresh(tmp_path: Path) -> None:
    """/dev/full takes the open and refuses every write (ENOSPC), as a full run folder does; a record that could not be
    written is not left in the buffer to fail again (or land twice) with the end record."""
    metrics = MetricsFile("/dev/full")
    with pytest.raises(MetricsWriteError, match=r"^the progress record could not be written to /dev/full: \[Errno 28\] No space left on device; make room"):
        metrics.write("progress", global_step=1)
    with pytest.raises(MetricsWriteError, match="the end record"):
        metrics.write("end", outcome="failed")
    metrics.close()
    good = MetricsFile(str(tmp_path / "m.jsonl"))
    good.write("progress", global_step=1)
    good.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1


def test_a_start_appending_after_a_torn_line_begins_a_line_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"time": 1, "kind": "progress"}\n{"time": 2, "ki')  # the last start was killed mid-write
    metrics = MetricsFile(str(path))
    metrics.write("start", global_step=0)
    metrics.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"time": 2, "ki' and json.loads(lines[2])["kind"] == "start" and len(lines) == 3


def test_a_snapshots_record_that_cannot_be_written_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    store.gate.set()

    def on_written(_: Written) -> None:
        raise MetricsWriteError("the snapshot record could not be written")

    writer = SnapshotWriter(store, on_written)
    writer.submit(_state(10), held_since=0.0)
    with pytest.raises(MetricsWriteError, match="the snapshot record"):
        writer.wait()
    assert [p.name for p in list_snapshots(tmp_path)] == [snapshot_name(10)]


def test_store_skips_corrupt_and_incomplete_and_never_deletes_them_but_clears_a_dead_writers_temp_file(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path, keep=1)
    store.save(_state(10))
    (tmp_path / snapshot_name(30)).write_bytes(b"not a zip file")
    torch.save({"format": 1, "model": {}}, tmp_path / snapshot_name(20))  # readable but missing keys
    (tmp_path / ".snapshot-0000000040.pt.tmp-1").write_bytes(b"half")  # a crash mid-write: never a candidate, removed
    reader = SnapshotStore(tmp_path, keep=1)
    _, path, reports = reader.load_latest()
    assert path == tmp_path / snapshot_name(10)
    assert len(reports) == 3 and "a crash interrupted" in reports[0] and "missing" in reports[2]
    reader.save(_state(11))  # rotation may drop 10, never the unreadable 20 and 30
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [snapshot_name(11), snapshot_name(20), snapshot_name(30)]


USER_TRAIN = "import sys\nprint('THE USER TRAIN RAN')\nsys.exit(3)\n"
USER_TASK = """from torch import nn
from torch.utils.data import TensorDataset
import torch

from train.tasks import Task


def make(config):
    torch.manual_seed(config.seed)
    x = torch.randn(64, 3)
    return Task("mine", nn.Linear(3, 1), TensorDataset(x, x.sum(1, keepdim=True)), nn.MSELoss())
"""


@pytest.mark.parametrize("shadow", ["train.py", "train/__main__.py"])
def test_a_train_module_in_the_working_directory_cannot_shadow_the_trainer(tmp_path: Path, shadow: str) -> None:
    """A project folder with its own train.py (or train/), as under `docker run -v $PWD:/workspace` or
    pyxis' --container-workdir: the entrypoint runs the bundled trainer, and --task still imports the
    user's module from that folder."""
    target = tmp_path / shadow
    target.parent.mkdir(exist_ok=True)
    target.write_text(USER_TRAIN)
    if shadow.startswith("train/"):
        (tmp_path / "train" / "__init__.py").write_text("")
    (tmp_path / "mytask.py").write_text(USER_TASK)
    env = clean_env()
    for args in (["--epochs", "1"], ["--task", "mytask:make", "--epochs", "1"]):
        out = subprocess.run(
            [sys.executable, "-m", "entrypoint", *args, "--snapshot-dir", ""],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "THE USER TRAIN RAN" not in out.stdout and "checksums agree across 1 ranks" in out.stdout
    assert "task mine " in out.stdout


def test_snapshots_that_exist_but_cannot_be_read_stop_the_run_instead_of_training_from_step_0(tmp_path: Path) -> None:
    """Every snapshot unreadable, or none where the metrics file records one (the folder briefly invisible): one line,
    exit 2, and the files left as they were (training from 0 would rotate them away once they are readable again)."""
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / snapshot_name(40)).write_bytes(b"torn")
    out = run_train("--epochs", "1", "--snapshot-dir", str(snap))
    assert out.returncode == 2 and f"none of the 1 snapshots in {snap} can be read (the newest: {snap / snapshot_name(40)} is unreadable" in out.stdout
    assert "Traceback" not in out.stderr and [p.name for p in snap.iterdir()] == [snapshot_name(40)]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        '{"time": 1, "kind": "snapshot", "global_step": 40, "path": "' + str(snap / snapshot_name(40)) + '"}\n{"time": 2, "kind": "progr\n'
    )
    (snap / snapshot_name(40)).unlink()
    with pytest.raises(SnapshotsUnreadable, match=f"records the snapshot of step 40 .*, but {snap} holds none"):
        SnapshotStore(snap).load_latest(metrics)
    assert SnapshotStore(tmp_path / "elsewhere").load_latest(metrics)[0] is None  # another folder's record: a new run
    assert SnapshotStore(snap).load_latest(tmp_path / "missing.jsonl")[0] is None


CHANGING_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from train.tasks import Task

def make(config):
    x = torch.randn(256, 3, generator=torch.Generator().manual_seed(0))
    model = nn.Linear(3, 1) if WIDTH == 1 else nn.Sequential(nn.Linear(3, WIDTH), nn.Linear(WIDTH, 1))
    return Task("mine", model, TensorDataset(x, x.sum(1, keepdim=True)), nn.MSELoss())
"""


def test_a_snapshot_of_a_model_that_changed_is_bad_input_not_a_failed_collective(tmp_path: Path) -> None:
    """The project's model changed between two starts of one run (its code, not a flag): one line, exit 2, not
    "a collective failed" (exit 1), which the job would restart for nothing."""
    snap = str(tmp_path / "snap")
    (tmp_path / "mytask.py").write_text("WIDTH = 1\n" + CHANGING_TASK)
    args = ("--task", "mytask:make", "--epochs", "1", "--snapshot-dir", snap)
    assert run_train(*args, cwd=tmp_path).returncode == 0
    (tmp_path / "mytask.py").write_text("WIDTH = 4\n" + CHANGING_TASK)
    again = run_train(*args, cwd=tmp_path)
    assert again.returncode == 2 and "does not fit this model" in again.stderr + again.stdout, again.stderr
    assert "a collective failed" not in again.stderr + again.stdout


def test_rerunning_a_finished_run_names_where_it_ended(tmp_path: Path) -> None:
    snap = str(tmp_path / "snap")
    assert run_train("--epochs", "1", "--snapshot-dir", snap).returncode == 0
    again = run_train("--epochs", "1", "--snapshot-dir", snap)
    assert again.returncode == 0, again.stderr
    assert "resumed after epoch 1/1 step 58/58 (global 58/58)" in again.stdout
    assert "training already complete at global step 58" in again.stdout


def test_a_snapshot_of_another_run_is_refused_unless_asked(tmp_path: Path) -> None:
    """Two runs pointed at one folder must not mix: other trajectory settings are an error that says
    what differs and how to go on."""
    snap = str(tmp_path / "snap")
    assert run_train("--epochs", "1", "--snapshot-dir", snap).returncode == 0
    other = run_train("--epochs", "2", "--batch-size", "64", "--lr", "0.001", "--snapshot-dir", snap)
    assert other.returncode == 2, other.stdout + other.stderr
    assert other.stderr == (
        f"train: error: the snapshot at global step 58 in {snap} belongs to a run with other settings "
        "(--batch-size 32 -> 64, --lr 0.003 -> 0.001); to start a new run give it its own --snapshot-dir (a new run directory), "
        "or pass --allow-changed-settings to continue that run with these settings\n"
    )
    assert "checksum" not in other.stdout  # nothing trained
    allowed = run_train("--epochs", "2", "--batch-size", "64", "--lr", "0.001", "--snapshot-dir", snap, "--allow-changed-settings")
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: continuing with changed settings (--batch-size 32 -> 64, --lr 0.003 -> 0.001)" in allowed.stdout
    assert "checksums agree across 1 ranks" in allowed.stdout


LOGGER = """
import sys
from train.metrics import RankLog
log = RankLog(int(sys.argv[1]), 4)
for i in range(20000):
    log(f"record {i}")
"""


def test_ranks_sharing_one_pipe_never_share_a_line() -> None:
    """torchrun's workers and srun's tasks write to one pipe, unbuffered in the image."""
    env = clean_env(PYTHONUNBUFFERED="1")
    cmd = " & ".join(f"{sys.executable} -c '{LOGGER}' {rank}" for rank in range(4)) + " & wait"
    out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 80000
    pattern = re.compile(r"\[rank [0-3]/4\] record \d+")
    assert [line for line in lines if not pattern.fullmatch(line)] == []


@pytest.mark.parametrize(
    ("local_rank", "local_world", "visible", "cuda_visible", "expected"),
    [
        (3, 8, 8, None, 3),  # one GPU per rank
        (1, 2, 8, None, 1),  # fewer ranks than GPUs
        (5, 8, 1, "5", 0),  # Slurm gave each task its own GPU (--gpus-per-task=1): one visible, a different one in each task
        (1, 8, 4, None, "8 ranks on this node but torch sees 4 GPUs (CUDA_VISIBLE_DEVICES=unset)"),
        (1, 2, 1, None, "2 ranks on this node but torch sees 1 GPU (CUDA_VISIBLE_DEVICES=unset)"),
        (
            1,
            4,
            2,
            "0,1",
            "4 ranks on this node but torch sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1); start one rank per GPU (--nproc-per-node 2",
        ),
    ],
)
def test_each_local_rank_gets_a_gpu_of_its_own_or_one_line(local_rank: int, local_world: int, visible: int, cuda_visible, expected) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": cuda_visible} if cuda_visible is not None else {}
    if isinstance(expected, int):
        assert choose_cuda_index(local_rank, local_world, visible, environ) == expected
    else:
        with pytest.raises(DeviceError, match=re.escape(expected)):
            choose_cuda_index(local_rank, local_world, visible, environ)


def test_per_batch_seeding_restores_the_cuda_generators_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.manual_seed also seeds every CUDA generator; fetching a batch in the training process
    must hand the model's dropout its CUDA state back, as it does the CPU state (stubbed: no GPU here)."""
    states = {"cuda": ["model's state"]}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states["cuda"]))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda new: states.update(cuda=list(new)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: states.update(cuda=[f"seeded {seed}"]))
    cpu_before = torch.get_rng_state()
    dataset = SeededBatches(torch.utils.data.TensorDataset(torch.arange(8.0)), seed=1, rank=0)
    dataset.__getitems__(BatchKey(epoch=0, index=3, indices=(1, 2)))
    assert states["cuda"] == ["model's state"] and torch.equal(torch.get_rng_state(), cpu_before)


def test_unused_parameters_are_named_from_ddps_indices() -> None:
    """DDP counts the parameters it syncs (frozen ones are not) from the wrapper's module tree."""
    model = torch.nn.Module()
    model.module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.module[0].requires_grad_(False)
    ddp_like = torch.nn.Module()
    ddp_like.module = model
    error = RuntimeError(
        "Expected to have finished reduction in the prior iteration ...\nParameter indices which did not receive grad for rank 1: 2 3\n ..."
    )
    assert unused_parameter_names(error, ddp_like) == ["2.weight", "2.bias"]
    assert unused_parameter_names(RuntimeError("Connection reset by peer"), ddp_like) is None


def test_end_records_are_read_back_from_interleaved_logs_whatever_the_prefix() -> None:
    """The end record is what tools read: found after any prefix (the rank's, docker's `r1 | `), amid other
    lines and torn ones, with a reason cut to keep the line one atomic write."""
    done = RunEnd(rank=0, world_size=2, host="n1", outcome="done", exit_code=0, global_step=10, total_steps=10, checksum="ab" * 8)
    failed = RunEnd(rank=1, world_size=2, host="n2", outcome="failed", exit_code=1, reason="x" * 5000)
    text = "\n".join(["[rank 0/2] epoch 1/1 step 10/10", f"[rank 0/2] {done.line()}", "ddpack-end {not json", f"  r1 | {failed.line()}"])
    ends = read_ends(text)
    assert ends[0] == done and ends[1].outcome == "failed" and len(ends[1].reason) == 1000 and len(failed.line()) < 4096
    assert checksums(text) == ["ab" * 8]
    assert "reason" not in done.fields() and done.fields()["checksum"] == "ab" * 8
    with pytest.raises(ValueError, match="outcome 'crashed' is not one of"):
        RunEnd(rank=0, world_size=1, host="h", outcome="crashed", exit_code=1)


def test_gpu_ranks_bind_to_the_cpus_of_their_own_gpus_numa_node(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-socket node (CPUs 0-7 on socket 0, 8-15 on socket 1) whose ranks 0-1 drive GPUs on socket 1
    and ranks 2-3 GPUs on socket 0: each rank's slice comes from its GPU's socket, not from rank order."""
    from train.affinity import gpu_local_cpus

    sixteen = tuple(range(16))
    socket0, socket1 = tuple(range(8)), tuple(range(8, 16))
    one = lambda cpus: [(cpu,) for cpu in cpus]  # noqa: E731
    assert plan_slices([(A, sixteen)] * 4, cores_of=one, near=[socket1, socket1, socket0, socket0]) == [
        (8, 9, 10, 11), (12, 13, 14, 15), (0, 1, 2, 3), (4, 5, 6, 7)
    ]
    # A GPU that does not say, or a NUMA node with fewer CPUs than its ranks: rank order over all the CPUs.
    assert plan_slices([(A, sixteen)] * 2, cores_of=one, near=[socket1, None]) == [socket0, socket1]
    assert plan_slices([(A, (0, 1, 8))] * 3, cores_of=one, near=[socket1, socket1, socket0]) == [(0,), (1,), (8,)]

    # The GPU's NUMA CPUs come from its PCI slot in sysfs (a fake one here: no GPU).
    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x53, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    (tmp_path / "sys/bus/pci/devices/0000:53:00.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:53:00.0/local_cpulist").write_text("48-95,144-191\n")
    assert gpu_local_cpus(torch.device("cuda", 0), tmp_path) == (*range(48, 96), *range(144, 192))
    assert gpu_local_cpus(torch.device("cpu"), tmp_path) is None
    assert gpu_local_cpus(torch.device("cuda", 1), tmp_path / "elsewhere") is None
