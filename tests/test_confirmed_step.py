"""Recovery's exactness, the parts that need no second process: a step's update is applied whole or not at all
(train/grad_sync.py's confirmed steps, here through the CUDA path's code with the CPU and gloo standing in for the GPU
and NCCL), and the state after a recovery comes from a rank whose confirmed step is the greatest (train/trainer.py's
state_source). The real thing, a rank killed between two buckets at four ranks, is tests/test_recovery_dist.py's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import train.grad_sync
from train.distributed import collective_failure, free_port
from train.grad_sync import IncompleteSync, SyncedModel
from train.recovery import RecoveryImpossible
from train.signals import PreemptionWatcher
from train.step_path import StepPath
from train.trainer import Trainer, buffer_holder, state_source

CPU = torch.device("cpu")


@pytest.fixture
def watcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[PreemptionWatcher]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    watching = PreemptionWatcher()
    yield watching
    watching.restore()
    dist.destroy_process_group()


class Aborted:
    """A bucket's all-reduce whose communicator was aborted under it, as ProcessGroupNCCL's watchdog leaves the work:
    it has completed (the aborted kernel returned, with partial sums) and holds an error, which no stream wait raises."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self) -> bool:
        return self.work.wait()

    def is_completed(self) -> bool:
        return True

    def exception(self) -> Any:
        return RuntimeError("NCCL communicator was aborted on rank 0")


def confirmed_step(watcher: PreemptionWatcher) -> tuple[SyncedModel, torch.optim.Optimizer]:
    """The CUDA path's step as --recovery runs it (DDP's C++ hook, or ddpack's Python hook where the backend keeps no
    error state; the host wait), on a CPU; gradients synced, not yet applied."""
    torch.manual_seed(0)
    module = nn.Linear(4, 1)
    path = replace(StepPath.cuda_shaped(CPU), confirmed=True)
    model = SyncedModel(
        module, watcher=watcher, world_size=1, device=CPU, compress=False, compiled=None, find_unused_parameters=False, path=path
    )
    model.zero_grads()
    model.backward(model(torch.ones(2, 4)).sum(), syncs=True)
    return model, torch.optim.SGD(module.parameters(), lr=0.1)


def test_a_confirmed_step_whose_all_reduce_completed_is_applied(watcher: PreemptionWatcher) -> None:
    model, optimizer = confirmed_step(watcher)
    before = model.ddp.module.module.weight.detach().clone()
    model.finish()  # the host waited for the step's end (the stand-in event) and found no collective failed
    optimizer.step()
    assert not torch.equal(before, model.ddp.module.module.weight)


def test_a_confirmed_step_after_the_process_group_saw_a_collective_fail_raises_before_the_optimizer(
    watcher: PreemptionWatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP's C++ hook syncs the step (no Python a bucket); the NCCL backend's error state, which its watchdog sets before
    it aborts the communicator under a dead peer, says that a collective failed: the update is not applied."""
    error_type = torch._C._distributed_c10d.ErrorType
    monkeypatch.setattr(train.grad_sync, "comm_error_state", lambda model, device: lambda: error_type.COMM_ERROR)
    hooked = []
    monkeypatch.setattr(train.grad_sync.GradientSync, "hook", lambda self, state, bucket: hooked.append(bucket))
    model, _ = confirmed_step(watcher)
    assert not hooked  # DDP's C++ hook synced the buckets, not ddpack's Python one
    with pytest.raises(IncompleteSync, match="the step's update is not applied") as raised:
        model.finish()  # the trainer's optimizer.step() comes after finish(): it does not run
    assert collective_failure(raised.value)  # recovered from as a peer's death, not this rank's own error


def test_without_an_error_state_a_confirmed_step_whose_all_reduce_was_aborted_raises_before_the_optimizer(
    watcher: PreemptionWatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose NCCL backend has no get_error: ddpack's Python hook keeps each bucket's work and finish() checks it."""
    monkeypatch.setattr(train.grad_sync, "comm_error_state", lambda model, device: None)
    launch = dist.all_reduce
    monkeypatch.setattr(train.grad_sync.dist, "all_reduce", lambda tensor, async_op: Aborted(launch(tensor, async_op=async_op)))
    model, _ = confirmed_step(watcher)
    with pytest.raises(IncompleteSync, match="the step's update is not applied") as raised:
        model.finish()
    assert collective_failure(raised.value)


def test_the_state_comes_from_a_rank_whose_confirmed_step_is_the_greatest_the_lowest_such() -> None:
    assert state_source([12, 12, -1, 12]) == 0
    assert state_source([11, 12, -1, 12]) == 1  # rank 1's all-reduce of step 11 completed, rank 0's did not
    assert state_source([-1, 11, 11, 12]) == 3  # a replacement (-1) has no state


def test_survivors_more_than_a_step_apart_fall_back() -> None:
    with pytest.raises(RecoveryImpossible, match="range from 10 to 12"):
        state_source([10, 12, -1, 12])


def test_the_runs_buffers_after_a_recovery_come_from_rank_0_or_from_a_survivor_that_received_them() -> None:
    """BatchNorm's statistics are rank 0's; a step's forward moves them before its sync can fail, and each rank keeps
    what DDP's broadcast gave it at its step's first forward (its `_received_at`)."""
    assert buffer_holder([12, 12, 12, 12], 12, rank_0_survived=True) == (0, True)  # inside step 12, after its forward
    assert buffer_holder([11, 11, 11, 11], 12, rank_0_survived=True) == (0, False)  # between steps: its own
    assert buffer_holder([11, 12, 12, 12], 12, rank_0_survived=True) == (0, False)  # a step behind: its own moved to 12's
    assert buffer_holder([-1, 12, 12, 12], 12, rank_0_survived=False) == (1, True)  # rank 0 died in step 12's sync
    assert buffer_holder([-1, 11, 12, 12], 12, rank_0_survived=False) == (2, True)  # rank 1 a step behind: none of 12's
    assert buffer_holder([-1, 11, 11, 11], 12, rank_0_survived=False) is None  # between steps: 12's were only on rank 0


def test_rank_0s_buffers_are_its_received_copy_inside_the_step_and_its_own_outside_it() -> None:
    received, own = [torch.tensor([1.0])], [torch.tensor([2.0])]  # the copy from the step's first forward, and now
    holder = SimpleNamespace(_received=received, _buffers=own)
    assert Trainer._boundary_buffers(holder, received=True)[0].item() == 1.0  # type: ignore[arg-type]
    assert Trainer._boundary_buffers(holder, received=False)[0].item() == 2.0  # type: ignore[arg-type]
