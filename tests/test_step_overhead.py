"""The GPU step's host work, counted, not timed: the trainer on its CUDA path's branches (train/step_path.py's
`cuda_shaped`, run here on the CPU) against bench_gpu's bare DDP loop, one steady step each, on bench_gpu's GPT at
two depths. What `make bench-host` times, this counts: Python lines and calls, aten ops, waits for the device. A
step's host work on an eager GPT on a GPU is its step time, so a per-parameter Python loop or a device sync a step
that creeps back in fails here first."""

from __future__ import annotations

import io
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import TensorDataset

import train.grad_sync
import train.torch_compat
from testbed.env import ROOT
from testbed.gpt import TinyGPT, bare_ddp_step, next_token_loss
from train.config import parse_config
from train.distributed import DistContext, free_port, init_distributed
from train.metrics import MetricsFile, RankLog
from train.model import compile_module
from train.signals import PreemptionWatcher
from train.step_path import StepPath
from train.tasks import Task
from train.trainer import Trainer
from train.watchdog import Progress

BATCH, STEPS = 2, 12
STEADY = 5  # DDP rebuilds its buckets at the second step; steps after this one are steady
OURS = str(ROOT / "train")


def shape(layers: int) -> dict[str, int | float]:
    return {"vocab": 64, "block_size": 8, "dim": 16, "heads": 4, "layers": layers, "dropout": 0.0}


def tokens(layers: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (BATCH * STEPS, 9), generator=gen)
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


@dataclass
class StepCount:
    """One steady step's host work."""

    lines: int = 0  # Python lines executed, anywhere
    lines_ours: int = 0  # in train/
    calls: int = 0  # Python functions entered
    aten: Counter[str] = field(default_factory=Counter)  # aten ops, as the profiler records them (nested ones too)


class Counting:
    """Traces one step (Python lines and calls), then profiles the next (aten ops): apart, so neither counts the other."""

    def __init__(self) -> None:
        self.count = StepCount()
        self.profiler: Any = None

    def _trace(self, frame: FrameType, event: str, _arg: object) -> Callable[..., Any]:
        if event == "call":
            self.count.calls += 1
        elif event == "line":
            self.count.lines += 1
            if frame.f_code.co_filename.startswith(OURS):
                self.count.lines_ours += 1
        return self._trace

    def start_tracing(self) -> None:
        frame = sys._getframe(1)
        while frame is not None:  # the frames already running (the training loop's) trace their lines too
            frame.f_trace, frame.f_trace_lines = self._trace, True
            frame = frame.f_back
        sys.settrace(self._trace)

    def stop_tracing(self) -> None:
        sys.settrace(None)
        frame = sys._getframe(1)
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back

    def start_profiling(self) -> None:
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.start()

    def stop_profiling(self) -> None:
        self.profiler.stop()
        self.count.aten = Counter(event.name for event in self.profiler.events() if event.name.startswith("aten::"))

    def at_step(self, step: int) -> None:
        """Called at each step's end (after `step` steps): trace the next step, then profile the one after."""
        if step == STEADY:
            self.start_tracing()
        elif step == STEADY + 1:
            self.stop_tracing()
            self.start_profiling()
        elif step == STEADY + 2:
            self.stop_profiling()


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[DistContext]:
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ctx = init_distributed("gloo", torch.device("cpu"), 60)
    yield ctx
    dist.destroy_process_group()


def cuda_shaped_trainer(ctx: DistContext, layers: int) -> tuple[Trainer, PreemptionWatcher]:
    """The trainer on the CUDA path's branches over bench_gpu's GPT; the watcher's signal handlers are the caller's to restore."""
    config = parse_config(["--amp", "--batch-size", str(BATCH), "--optimizer", "adamw", "--lr-schedule", "constant", "--epochs", "1",
                           "--log-every", "1000", "--snapshot-dir", "", "--hang-timeout", "0", "--cpu-bind", "none"])  # fmt: skip
    torch.manual_seed(0)
    task = Task("gpt", TinyGPT(**shape(layers)), tokens(layers), next_token_loss)
    watcher = PreemptionWatcher()
    return Trainer(config, task, ctx, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher, Progress(), path=StepPath.cuda_shaped(ctx.device)), watcher


def trainer_step(ctx: DistContext, layers: int, device_waits: list[str]) -> StepCount:
    """The trainer's steady step on the CUDA path's branches, from one step's end (its stop-flag poll, its
    bookkeeping) through the next step's data, zeroing, forward, backward and optimizer."""
    counting = Counting()
    trainer, watcher = cuda_shaped_trainer(ctx, layers)
    poll = trainer.model.agreed_stop

    def agreed_stop() -> Any:  # the last thing of a step: where one step's count ends and the next one's begins
        agreed = poll()
        counting.at_step(trainer.global_step)
        return agreed

    trainer.model.agreed_stop = agreed_stop  # type: ignore[method-assign]
    try:
        trainer.fit()
    finally:
        watcher.restore()
    late = trainer.model.sync._late
    assert late is not None and late.event.__class__.__name__ == "_DoneEvent"
    device_waits.extend(["the stop flags' event"] * late.waits)
    return counting.count


def bare_step(ctx: DistContext, layers: int) -> StepCount:
    """bench_gpu's bare DDP loop (testbed.gpt.bare_ddp_step) over the same GPT and tokens."""
    counting = Counting()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(**shape(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    data = tokens(layers).tensors
    for step in range(STEPS):
        bare_ddp_step(model, optimizer, data, step, BATCH, ctx.device)
        counting.at_step(step + 1)
    return counting.count


def test_the_cuda_paths_step_adds_no_per_parameter_work_and_no_device_wait(group: DistContext, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[str] = []
    # The late read's stand-in event: query() answers; a synchronize() would be the host waiting for the device.
    with monkeypatch.context() as patched:
        patched.setattr(train.grad_sync._DoneEvent, "query", lambda self: False)  # as if the GPU were behind: it must wait, once a step
        trainer_step(group, 2, waits)
    assert waits.count("the stop flags' event") >= STEPS - 2, waits  # the wait is there when the device is behind...
    waits.clear()
    counts = {(side, layers): (trainer_step(group, layers, waits) if side == "trainer" else bare_step(group, layers))
              for layers in (2, 4) for side in ("trainer", "bare")}  # fmt: skip
    assert waits == [], waits  # ...and never when it is not: no device sync a steady step
    trainer2, trainer4, bare2, bare4 = counts["trainer", 2], counts["trainer", 4], counts["bare", 2], counts["bare", 4]
    summary = {key: (c.lines, c.lines_ours, c.calls, sum(c.aten.values())) for key, c in counts.items()}
    # Two more layers are 24 more parameter tensors: ddpack's own code runs the same lines however many there are.
    assert trainer4.lines_ours == trainer2.lines_ours, summary
    # Everything else a step runs grows with the layers in both (the model's forward, DDP, AdamW's grouping), and
    # the bare loop's zero_grad walks the parameters in Python on top: the trainer's step grows by less.
    assert trainer4.lines - trainer2.lines < bare4.lines - bare2.lines, summary
    for layers in (2, 4):
        trainer, bare = counts["trainer", layers], counts["bare", layers]
        # The host work the trainer adds to a bare loop's step, whole: its own lines (the step, the poll, the marks).
        assert trainer.lines - bare.lines <= 120 and trainer.calls - bare.calls <= 40, summary
        # No more aten ops than the bare loop: one zeroing of the buckets, no per-parameter division, no copy back.
        assert sum(trainer.aten.values()) <= sum(bare.aten.values()), summary
        # No read that would wait for a GPU beyond the bare loop's (fused AdamW reads each step count on a CPU).
        assert trainer.aten["aten::_local_scalar_dense"] <= bare.aten["aten::_local_scalar_dense"], (trainer.aten, bare.aten)
        assert trainer.aten["aten::div_"] == 0 and trainer.aten["aten::_foreach_zero_"] == 1, trainer.aten  # one rank: nothing to divide


def test_compile_at_one_rank_keeps_the_graph_whole() -> None:
    """Dynamo's DDP optimizer splits a compiled graph at every bucket for an overlap one rank cannot use: off at one
    rank (train.model.compile_module says what it cost), left as torch sets it with more. torch's own config.patch puts
    the setting back after (pytest's monkeypatch would delete it from torch's config, which then hides it)."""
    import torch._dynamo as dynamo

    with dynamo.config.patch(optimize_ddp=True):
        compile_module(torch.nn.Linear(2, 2), world_size=2)
        assert dynamo.config.optimize_ddp is True
        compile_module(torch.nn.Linear(2, 2), world_size=1)
        assert dynamo.config.optimize_ddp is False
    assert dynamo.config.optimize_ddp is True  # torch's default, for the tests after this one


def test_a_torch_without_ddps_bucket_flag_zeroes_the_gradients_one_by_one_to_the_same_numbers(group: DistContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeroing DDP's buckets whole rests on a private flag of DDP (train/torch_compat.py's ddp_buckets_final); a torch
    without it takes the per-parameter zeroing, and trains to the same parameters bit for bit."""

    def fitted(buckets_final: Callable[[DistributedDataParallel], bool]) -> tuple[list[torch.Tensor], bool]:
        monkeypatch.setattr(train.grad_sync, "ddp_buckets_final", buckets_final)
        trainer, watcher = cuda_shaped_trainer(group, 2)
        try:
            trainer.fit()
        finally:
            watcher.restore()
        return [p.detach().clone() for p in trainer.model.ddp.parameters()], trainer.model._buckets is not None

    whole, by_bucket = fitted(train.torch_compat.ddp_buckets_final)
    one_by_one, by_bucket_without = fitted(lambda ddp: False)
    assert by_bucket and not by_bucket_without
    assert all(torch.equal(a, b) for a, b in zip(whole, one_by_one, strict=True))
