"""A standby that leaves without taking a rank, or cannot start, says so to the job's program in a record (issue 62,
point 3): its last line is train/outcome.py's StandbyEnd, and the job's program (enroot/ddpack_step.py) says one
line naming the standby, its node and why."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from ddpack.job_side import module
from entrypoint.plan import JOB_TOKEN_VAR
from train import recovery
from train.outcome import STANDBY_MARK, StandbyEnd, read_standby_ends
from train.recovery_channel import Channel
from train.signals import PreemptionWatcher

TOKEN = "3f9a0c1d5e7b2468ace013579bdf8642"


def leave(monkeypatch: pytest.MonkeyPatch, port: int, store: Callable[..., dist.Store] | None = None) -> list[StandbyEnd]:
    """`python -m train --standbys 1` as the launcher's last task (RANK 2 of 3) on node ddnode2, entered until it leaves
    (`store`: the store clients it gets): the records among its lines."""
    if store is not None:
        monkeypatch.setattr(recovery, "_store", store)
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SLURMD_NODENAME": "ddnode2"}
    for name, value in {**env, JOB_TOKEN_VAR: TOKEN, "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    watcher = PreemptionWatcher()
    try:
        entered = recovery.enter(
            standby=False, standbys=1, backend="gloo", device=torch.device("cpu"), collective_timeout_s=5,
            log=lines.append, watcher=watcher,
        )  # fmt: skip
    finally:
        watcher.restore()  # SIGTERM ends the test process again
    assert entered is None
    assert lines[-1].startswith(STANDBY_MARK), lines  # its last line
    return read_standby_ends("\n".join(lines))


def test_a_standby_whose_warm_up_fails_says_it_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: torch.device, watcher: PreemptionWatcher) -> None:
        raise ImportError("No module named 'train.grad_sync'")

    monkeypatch.setattr(recovery, "warm_up", broken)
    assert leave(monkeypatch, 1) == [
        StandbyEnd("s0", "ddnode2", "cannot-start", "its warm-up failed (ImportError: No module named 'train.grad_sync')")
    ]


def test_a_standby_without_a_store_says_the_store_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_store(is_master: bool, connect_s: float = 0) -> dist.TCPStore:
        raise RuntimeError("connect() timed out")

    monkeypatch.setattr(recovery, "warm_up", lambda device, watcher: None)
    monkeypatch.setattr(recovery, "_store", no_store)
    [end] = leave(monkeypatch, 1)
    assert (end.member, end.host, end.why) == ("s0", "ddnode2", "store-gone") and "connect() timed out" in end.detail


def test_a_standby_the_run_did_not_need_says_the_run_ended(monkeypatch: pytest.MonkeyPatch, server: dist.TCPStore) -> None:
    monkeypatch.setattr(recovery, "warm_up", lambda device, watcher: None)
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv(JOB_TOKEN_VAR, TOKEN)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    Channel.of_job(server, dict(os.environ), print).close()  # the ranks' end of the run
    [end] = leave(monkeypatch, server.port)
    assert end == StandbyEnd("s0", "ddnode2", "run-over", "the run ended without needing it", 0)


@pytest.fixture(scope="module")
def steps() -> ModuleType:
    return module("ddpack_step")


def test_the_job_program_says_which_standby_left_on_which_node_and_why(steps: ModuleType, capfd: pytest.CaptureFixture[str]) -> None:
    assert steps.STANDBY_END_MARK.decode() == STANDBY_MARK  # the trainer's mark, which the job reads
    record = StandbyEnd("s1", "ddnode3", "store-gone", "the job's store stopped answering (Broken pipe): rank 0's node lost")
    script = f"import sys; print('[standby] ' + {record.line()!r}); print('[standby] ddpack-standby-end not json')"
    step = steps.run_step([sys.executable, "-c", script])
    said = capfd.readouterr().out.splitlines()
    assert step.code == 0 and [r["member"] for r in step.standbys_left] == ["s1"]
    assert "ddpack: standby s1 on ddnode3 left (store-gone): the job's store stopped answering (Broken pipe): rank 0's node lost" in said
    assert len([line for line in said if line.startswith("ddpack: standby")]) == 1, said  # a damaged line says nothing


def test_a_standby_whose_node_has_no_temp_directory_says_it_cannot_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(recovery, "warm_up", lambda device, watcher: None)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "gone"))
    [end] = leave(monkeypatch, 1, store=lambda is_master, connect_s=0: dist.HashStore())
    assert (end.member, end.why) == ("s0", "cannot-start") and "temp directory (TMPDIR)" in end.detail, end
