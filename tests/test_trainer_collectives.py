"""The trainer in one process with a real (one-rank gloo) process group: which collectives a step
costs, and the stop flag riding in DDP's gradient sync; and the gradient-sync hook in a real
two-rank job against DDP's own all-reduce."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ddp_jobs import grad_sync_pair_reports
from torch.profiler import ProfilerActivity, profile

from train.config import parse_config
from train.distributed import DistContext, free_port, init_distributed, select_device
from train.metrics import MetricsFile, RankLog
from train.signals import PreemptionWatcher
from train.tasks import Task, load_task
from train.trainer import Preempted, Trainer
from train.watchdog import UNTIMED, Progress


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[DistContext]:
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = init_distributed(*select_device("gloo"), 60)
    yield ctx
    dist.destroy_process_group()


def collectives(run: Callable[[], object]) -> tuple[Counter[str], Preempted | None]:
    """The gloo collectives `run` performs, from the profiler (those DDP's reducer issues from C++ as
    well as those called from Python), and the stop it ended with, if any."""
    stopped = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            run()
        except Preempted as stop:
            stopped = stop
    return Counter(event.name for event in prof.events() if event.name.startswith("gloo:")), stopped


def fit(ctx: DistContext, *flags: str, signal_first: signal.Signals | None = None) -> tuple[Trainer, Counter[str], Preempted | None]:
    """Train the regression task for 2 epochs in this process; `signal_first` arrives before the first step."""
    config = parse_config(["--snapshot-dir", "", "--epochs", "2", *flags])
    watcher = PreemptionWatcher()
    trainer = Trainer(config, load_task(config), ctx, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher)
    watcher.received = signal_first  # as the handler would set it
    try:
        calls, stop = collectives(trainer.fit)
    finally:
        watcher.restore()
    return trainer, calls, stop


def test_a_step_costs_only_the_gradient_sync(group: DistContext) -> None:
    trainer, calls, _ = fit(group, "--log-every", "1000000")
    assert trainer.global_step == 116  # 1843 training samples / batch 32 = 58 steps an epoch
    # One gradient sync a step (the regression model's 21 gradients and the stop flags, small enough
    # to be exchanged by one all-gather), one all-reduce for the last progress line, the checksum
    # gather at the end (all_gather_object: sizes, then data) and DDP's one-time bucket rebuild after
    # the first step (two broadcasts): nothing else, however many steps.
    assert calls == Counter({"gloo:all_gather": 116 + 2, "gloo:all_reduce": 1, "gloo:broadcast": 2})


def test_a_model_over_a_mebibyte_still_syncs_in_one_collective_a_step_on_cpu(group: DistContext) -> None:
    """DDP's default 1 MiB first bucket would split this 1.05 MiB model's gradients in two, two
    collectives a step; on CPU the trainer asks for one bucket cap for all buckets."""
    config = parse_config(["--snapshot-dir", "", "--epochs", "1", "--log-every", "1000000"])
    seed = load_task(config)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)
    )
    assert sum(p.numel() * p.element_size() for p in model.parameters()) > 2**20
    watcher = PreemptionWatcher()
    trainer = Trainer(
        config, Task("wide", model, seed.train_data, torch.nn.MSELoss()), group, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher
    )
    try:
        calls, _ = collectives(trainer.fit)
    finally:
        watcher.restore()
    # 58 steps, each one all-reduce of the one bucket (too large to exchange), and the last progress line's
    assert calls == Counter({"gloo:all_reduce": 58 + 1, "gloo:all_gather": 2, "gloo:broadcast": 2})


@pytest.mark.parametrize(("bound", "expected"), [(False, 3), (True, 7)])
def test_a_bound_rank_defaults_its_loader_workers_from_its_whole_slice(
    group: DistContext, monkeypatch: pytest.MonkeyPatch, bound: bool, expected: int
) -> None:
    """8 CPUs: two local ranks sharing them get 8 / 2 - 1 workers each; a rank bound to its own 8
    (train.affinity) shares them with nobody and gets 8 - 1."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    config = parse_config(["--snapshot-dir", "", "--task", "plugins.augmented_task:make"])
    ctx = dataclasses.replace(group, local_world_size=2, cpus_bound=bound)
    trainer = Trainer(config, load_task(config), ctx, RankLog(0, 1, io.StringIO()), MetricsFile(None), PreemptionWatcher())
    try:
        assert trainer.batches.loader.num_workers == expected
    finally:
        trainer.watcher.restore()
        trainer.batches.close()


def test_the_learning_rate_of_each_step_is_what_torchs_lambda_scheduler_gives(group: DistContext) -> None:
    """The trainer sets each step's rate from the step alone (no scheduler state to save or restore);
    it must match, float for float, LambdaLR stepped once per optimizer step with the same factor."""
    config = parse_config(["--snapshot-dir", "", "--epochs", "2", "--warmup-steps", "5", "--log-every", "1000000"])
    watcher = PreemptionWatcher()
    trainer = Trainer(config, load_task(config), group, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher)
    used: list[float] = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    try:
        trainer.fit()
    finally:
        watcher.restore()
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(reference, trainer._lr_factor)
    expected = []
    for _ in range(trainer.total_steps):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert used == expected
    assert used[0] == config.lr / 5 and used[4] == config.lr and used[-1] < 0.06 * config.lr  # warm-up, then cosine


def test_progress_lines_add_one_all_reduce_each(group: DistContext) -> None:
    _, calls, _ = fit(group, "--log-every", "10")
    assert calls["gloo:all_reduce"] == 12  # progress at steps 10, 20, ..., 110 and the last
    assert calls["gloo:all_gather"] == 116 + 2


def test_every_collective_after_the_first_step_waits_in_a_timed_phase(
    group: DistContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog counts a rank in an untimed phase (a snapshot's write, eval) as making progress while
    its heartbeat is fresh; a rank waiting there on a frozen peer would hide the hang until the collective
    timeout (seen: a rank frozen before a snapshot's gather of the RNG states). So every collective the
    trainer calls once its first step is done, snapshots, evals and a stop's included, is called in a
    timed phase; the ones before (set-up, resume) are not timed at all."""
    watched = [Progress()]  # the running trainer's
    seen: list[tuple[str, str, bool]] = []

    def recorded(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            seen.append((name, watched[-1].phase, watched[-1].armed))
            return real(*args, **kwargs)

        return call

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, recorded(name, getattr(dist, name)))
    # Two epochs of 58 steps: progress lines, periodic snapshots, the end-of-epoch eval and the final checksum;
    # then a stop right after the first step of a second run: its durable snapshot and the leaving barrier.
    config = parse_config(["--snapshot-dir", str(tmp_path), "--snapshot-every", "7", "--epochs", "2", "--log-every", "5"])
    watcher = PreemptionWatcher()
    try:
        Trainer(config, load_task(config), group, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher, watched[-1]).fit()
        again = parse_config(["--snapshot-dir", str(tmp_path / "again"), "--epochs", "1"])
        watcher.received = signal.SIGTERM  # as the handler would set it
        watched.append(Progress())
        with pytest.raises(Preempted):
            Trainer(again, load_task(again), group, RankLog(0, 1, io.StringIO()), MetricsFile(None), watcher, watched[-1]).fit()
    finally:
        watcher.restore()
    timed = [(name, phase) for name, phase, armed in seen if armed]
    assert {phase for _, phase in timed} >= {"metrics", "snapshot-gather", "step-end"}, seen
    assert [(name, phase) for name, phase in timed if phase in UNTIMED] == [], seen


def test_gradient_sync_matches_ddp_all_reduce_bit_for_bit_on_two_ranks() -> None:
    """Both of the hook's paths (a small bucket exchanged by all-gather and summed in rank order, a
    large one all-reduced), with the stop flags in either kind of bucket, give exactly the gradients
    of DDP's own all-reduce once finish() has completed the buckets; a signal at rank 1 alone is
    agreed by both ranks at that step; no bucket is copied to carry the flags; a DDP without
    bucket-view gradients, or without the flags, is refused. Compressed (--bf16-grads), both paths give
    gradients within bfloat16's rounding, the same on both ranks, and the same agreed stop."""
    reports = grad_sync_pair_reports("cpu")
    for report in reports:
        for name in ("small-last", "large-last"):
            # Once DDP has rebuilt its buckets after the first step, a step exchanges the 16 KiB layer
            # (one all-gather) and all-reduces the 1 MiB one.
            small, large = sorted(report[name]["layer_bytes"])
            assert 2 * small <= report[name]["exchange_max"] < 2 * large
            assert report[name]["calls"][1:] == [{"gloo:all_gather": 1, "gloo:all_reduce": 1}] * 3, (report["rank"], name)
            assert report[name]["same_grads"] == [True] * 4, (report["rank"], name)
            assert report[name]["polls"] == [None, None, "SIGTERM", "SIGTERM"], (report["rank"], name)
            assert report[name]["refuses_copied_gradients"] == [True, True]  # without bucket views; without the flags
            # The flags ride in a bucket as a parameter's gradient: once DDP's first step has made the
            # gradients views of its buckets, nothing the size of the 1 MiB layer is copied, whether
            # the flags share its bucket or the small one.
            assert max(report[name]["largest_copy_elements"][1:]) < large // 4, (report["rank"], name)
            packed = report[name]["packed"]  # --bf16-grads: within bfloat16's rounding of DDP's, not equal to it
            assert packed["close"] == [True] * 4 and packed["exact"] == [False] * 4 and packed["polls"] == report[name]["polls"], name
    for name in ("small-last", "large-last"):
        assert reports[0][name]["packed"]["digests"] == reports[1][name]["packed"]["digests"]  # both ranks, the same gradients


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_before_a_step_stops_right_after_it_with_no_extra_collective(group: DistContext, sig) -> None:
    trainer, calls, stop = fit(group, "--log-every", "1000000", signal_first=sig)
    assert stop is not None and trainer.global_step == 1
    assert stop.signum == int(sig)
    assert f"stopped on {sig.name} (received here) at epoch 1/2 step 1/58 (global 1/116)" in str(stop)
    assert calls == Counter({"gloo:all_gather": 1, "gloo:barrier": 1})  # the step's gradient sync; the stop's barrier


def test_clipping_bounds_the_synced_gradients_norm(group: DistContext) -> None:
    """One plain SGD step (no momentum): parameters move by lr x the clipped gradients, whose norm is
    the clip; the metrics record the norm before clipping."""
    config = parse_config(["--snapshot-dir", "", "--max-steps", "1", "--optimizer", "sgd", "--momentum", "0", "--lr-schedule", "constant",
                           "--lr", "0.5", "--clip-grad-norm", "1e-3"])  # fmt: skip
    metrics = io.StringIO()
    sink = MetricsFile(None)
    sink.write = lambda kind, **fields: metrics.write(json.dumps({"kind": kind, **fields}) + "\n")  # type: ignore[method-assign]
    watcher = PreemptionWatcher()
    try:
        trainer = Trainer(config, load_task(config), group, RankLog(0, 1, io.StringIO()), sink, watcher)
        before = [p.detach().clone() for p in trainer.module.parameters()]
        trainer.fit()
    finally:
        watcher.restore()
    moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(trainer.module.parameters(), before, strict=True)])
    assert torch.linalg.vector_norm(moved).item() == pytest.approx(0.5 * 1e-3, rel=1e-4)
    progress = [json.loads(line) for line in metrics.getvalue().splitlines() if '"progress"' in line]
    assert progress[-1]["grad_norm"] > 1e-3  # the regression task's first gradient is far larger than the clip


def test_bf16_grads_under_amp_train_with_the_same_one_collective_a_step(group: DistContext) -> None:
    trainer, calls, _ = fit(group, "--log-every", "1000000", "--amp", "--bf16-grads")
    assert trainer.model.compress and trainer.global_step == 116
    assert calls == Counter({"gloo:all_gather": 116 + 2, "gloo:all_reduce": 1, "gloo:broadcast": 2})
