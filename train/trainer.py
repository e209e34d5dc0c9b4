"""The DDP training loop: exact resume, agreed stops, snapshots on rank 0, cross-rank checksums.

Position in training is (epoch, step_in_epoch, global_step), counted in optimizer steps. The sampler's
order for an epoch is a pure function of (seed, epoch), so resuming means restoring that position and
skipping the batches already consumed: nothing is replayed and nothing is skipped twice.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.data import default_collate

from train import run_folder
from train.affinity import bind_replacement, cpu_list
from train.config import DIE_IN_PROGRESS, DIE_IN_SNAPSHOT, Config, death_in_sync, death_on_file
from train.data import Batch, EpochOrder, default_num_workers, make_batches
from train.distributed import (
    DistContext,
    broadcast_buffers,
    broadcast_from_main,
    broadcast_objects,
    collective_failure,
    first_line,
    gather_objects,
    sum_over_ranks,
)
from train.gpu import set_tf32
from train.grad_sync import SyncedModel
from train.metrics import MetricsFile, RankLog, format_duration, format_share, start_fields
from train.model import compile_module, explain_setup_failure, prepare_module
from train.perf import CPU_MEASURE_S, MfuMeter, RankTimes, SlowRanks, precision
from train.preflight.compute import matmul_gflops
from train.recovery import Recovery, RecoveryImpossible
from train.signals import PreemptionWatcher
from train.snapshot import Snapshot, SnapshotStore, SnapshotWriter, Written
from train.step_path import StepPath
from train.tasks import Task
from train.watchdog import Phase, Progress


class Preempted(Exception):
    """All ranks agreed to stop on a signal; rank 0 has written a snapshot."""

    def __init__(self, signal_name: str, signum: int, message: str, snapshot: str | None) -> None:
        super().__init__(message)
        self.signal_name, self.signum, self.snapshot = signal_name, signum, snapshot


class SnapshotMismatch(Exception):
    """The snapshot belongs to a run with other trajectory settings: continuing it silently would mix
    two runs into one."""


class ChecksumMismatch(Exception):
    """Ranks ended with different parameters: DDP's core promise was broken."""


@dataclass(frozen=True, kw_only=True)
class Result:
    global_step: int
    final_loss: float | None
    checksum: str
    steps_per_s: float
    samples_per_s: float


@dataclass
class Window:
    """Progress since the last progress line. Step losses stay on the device and are summed only when
    a line is printed: reading them every step would wait for the device every step."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # before clipping, with --clip-grad-norm
    samples: int = 0
    started: float = field(default_factory=time.monotonic)
    data_s: float = 0.0  # this rank's time waiting for batches
    sync_s: float = 0.0  # this rank's time waiting for the gradients' all-reduce

    def add(self, loss: torch.Tensor, samples: int, grad_norm: torch.Tensor | None, sync_s: float) -> None:
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        self.samples += samples
        self.sync_s += sync_s


def parameter_checksum(module: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) over every parameter and buffer, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def state_source(steps: list[int]) -> int:
    """The rank whose state every rank takes after a recovery: one whose last *confirmed* step (train.grad_sync: a
    step's optimizer runs only once its all-reduce completed on that rank) is the greatest, the lowest such rank.
    `steps`: each rank's, -1 for a replacement (it has none). Survivors differ by one step at most: completing step s
    on any rank needs every rank's contribution to it, so no rank can have started step s + 1's sync while another
    had not yet contributed to step s's; a spread of more says the ranks' states cannot be trusted (RecoveryImpossible).
    Taking the state of a rank one step ahead is exact: its step s applied the whole sum of every rank's gradients,
    computed from the one state all held at s, which is the uninterrupted run's step s; a rank behind never applied
    its half of step s (its optimizer did not run) and takes the state after s whole."""
    ahead = max(steps)
    behind = min((s for s in steps if s >= 0), default=ahead)
    if ahead - behind > 1:
        raise RecoveryImpossible(
            f"the survivors' confirmed steps range from {behind} to {ahead}: a step apart at most is what a death mid-sync leaves"
        )
    return steps.index(ahead)


def buffer_holder(received: list[int], at: int, *, rank_0_survived: bool) -> tuple[int, bool] | None:
    """The rank that holds the run's buffers after `at` confirmed steps (`at`: the state source's), and whether they
    are its received copy (True) or its own buffers (False); None when no live rank holds them. `received`: each
    rank's `Trainer._received_at`, the global step at whose first forward it kept what DDP's broadcast gave it
    (-1 for a replacement). Call B(s) rank 0's buffers after its forward of step s - 1: what DDP broadcasts at step
    s's first forward, what every rank holds from that broadcast until its own forward moves them; the run's.
    - Rank 0 alive, received copy of step `at`: the death came inside step `at`, after rank 0's first forward of it
      (in that step's sync, or in a later micro-batch), which moved its buffers since; the copy is B(at).
    - Rank 0 alive, no copy of step `at` (between steps, `at` counted and step `at` not begun; or a step behind the
      source, failed in step at - 1's sync after that step's forward moved its buffers to B(at)): its own are B(at).
      It cannot be a step behind without having run step at - 1's forward: the source's sync of that step completed,
      which needs rank 0's gradients, computed by that forward.
    - Rank 0 dead, a survivor with a copy of step `at` (rank 0's death inside step `at`, after the broadcast reached
      that survivor; a survivor a step behind never reached step `at`'s forward and has none): that copy is B(at),
      sent by rank 0 itself. The lowest such rank supplies it.
    - Rank 0 dead, no survivor with a copy of step `at`: rank 0 died after its forward of step at - 1 (its gradients
      of that step were summed) and before its broadcast of step `at` reached anyone: between steps, or in step
      at - 1's sync. B(at) existed only in rank 0's memory; no survivor's buffers are it (theirs moved by their own
      batches, their copies B(at - 1)): None, and a model whose buffers move falls back (`Trainer._take_state`)."""
    if rank_0_survived:
        return 0, received[0] == at
    holders = [rank for rank, step in enumerate(received) if step == at]
    return (holders[0], True) if holders else None


class Trainer:
    def __init__(
        self,
        config: Config,
        task: Task,
        ctx: DistContext,
        log: RankLog,
        metrics: MetricsFile,
        watcher: PreemptionWatcher,
        progress: Progress | None = None,
        path: StepPath | None = None,
        recovery: Recovery | None = None,
    ) -> None:
        """`path`: the step's device-dependent branches; the device's own unless given (bench/bench_host.py runs
        the CUDA path's on a CPU). `recovery`: --recovery's collaborator (train/recovery.py); a standby that took a dead rank's
        place (`recovery.replacing`) takes its state from the survivors instead of a snapshot."""
        self.config, self.task, self.ctx, self.log, self.metrics, self.watcher = config, task, ctx, log, metrics, watcher
        path = path if path is not None else StepPath.for_device(ctx.device)
        if config.bucket_cap_mb is not None:
            path = replace(path, bucket_cap_mb=config.bucket_cap_mb)
        # Under --recovery a step's update is applied whole or not at all (train/grad_sync.py: confirmed steps).
        self.path = replace(path, confirmed=True) if recovery is not None else path
        # Where this rank is, for the hang watchdog (train.watchdog): a few attribute stores a step.
        self.progress = progress if progress is not None else Progress()
        self.module = prepare_module(task.model, config, ctx.device)
        set_tf32(ctx.device, config.tf32)  # before the peak is found: it is looked up in the precision trained in
        self.autocast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if config.amp else nullcontext
        self.recovery = recovery
        # Rank 0 finds the device's peak at start and counts the model's FLOPs at its first step.
        self.mfu = MfuMeter(log)
        self.counted = not ctx.is_main
        # Under --recovery every rank keeps the buffers (BatchNorm's running statistics) it received from rank 0 in DDP's
        # broadcast at the first forward of the step it is in (`_receive_buffers`, a pre-hook on the module DDP wraps: it
        # runs after that broadcast, before the forward moves them). The run's buffers are rank 0's, and a step's forward
        # moves them before its sync can fail: the step redone after a recovery must start from rank 0's buffers as they
        # stood at its start, and when rank 0 is the rank that died, a survivor's received copy is where they still are.
        self._buffers = [b for b in self.module.buffers() if b.numel()] if recovery is not None else []
        self._received = [b.clone() for b in self._buffers]
        self._received_at = -1  # the global step at whose first forward `_received` was taken
        self._receiving: int | None = None  # the global step whose first forward is still to come; None between
        self._bind(ctx)
        self.trained = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = self._make_optimizer()
        order = EpochOrder(len(task.train_data), world_size=ctx.world_size, rank=ctx.rank, batch_size=config.batch_size, seed=config.seed)
        workers = (
            config.num_workers if config.num_workers is not None else default_num_workers(1 if ctx.cpus_bound else ctx.local_world_size)
        )
        self.batches = make_batches(
            task.train_data, order, ctx.device, num_workers=workers, seed=config.seed, rank=ctx.rank, pinned=self.path.cuda
        )
        self.batches_per_epoch = order.batches_per_epoch
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / config.grad_accum)
        total = config.epochs * self.steps_per_epoch
        self.total_steps = min(total, config.max_steps) if config.max_steps else total
        self.store = SnapshotStore(Path(config.snapshot_dir), config.keep_snapshots) if config.snapshot_dir and ctx.is_main else None
        self.writer = SnapshotWriter(self.store, self._snapshot_written) if self.store is not None else None
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.last_snapshot_step = -1
        self.last_progress_step = -1  # the global step of the last progress line (set as the loop starts)
        self.window = Window()  # since the last progress line: kept through a recovery, for the line its death interrupted
        armed = recovery is not None and not recovery.replacing  # the tests-only deaths (train.config's DIE_IN_*)
        self._die_at = death_in_sync(os.environ) if armed else None
        self._die_in_progress = death_on_file(os.environ, DIE_IN_PROGRESS, ctx.rank) if armed else None
        self._die_in_snapshot = death_on_file(os.environ, DIE_IN_SNAPSHOT, ctx.rank) if armed else None

    # ------------------------------------------------------------------ set-up

    def _bind(self, ctx: DistContext) -> None:
        """What holds the process group: the ranks' hosts and DDP. Done again on a new group after a recovery,
        in the same order on the survivors and on the standby that joins them."""
        self.ctx = ctx
        self.hosts: list[str] = gather_objects(ctx.host, ctx)
        self.slow_ranks = SlowRanks(self.hosts)  # for the progress line that names a slow rank
        # DDP wraps the module with the stop-flag parameter beside it (train.grad_sync); the optimizer,
        # snapshots and checksums see the module alone (never the compiled one: its state dict's names
        # carry a prefix).
        self.model = SyncedModel(
            self.module,
            watcher=self.watcher,
            world_size=ctx.world_size,
            device=ctx.device,
            compress=self.config.bf16_grads,
            compiled=compile_module(self.module, world_size=ctx.world_size) if self.config.compile else None,
            find_unused_parameters=self.config.find_unused_parameters,
            path=self.path,
            sync_initial_state=self.recovery is None or self.recovery.generation == 0,  # a new generation's: _take_state's
        )
        if self._buffers:
            self.model.ddp.module.register_forward_pre_hook(self._receive_buffers)
        if self.recovery is not None:
            self.recovery.relax()

    def _receive_buffers(self, _module: torch.nn.Module, _inputs: Any) -> None:
        """DDP's wrapped module's forward pre-hook, under --recovery with buffers: at a step's first forward (armed by
        `_recoverable_step`; never the eval's, the FLOP count's or `_settle_buckets`' forward), the buffers just
        received from rank 0 (DDP broadcasts them before it calls the module), kept before the forward moves them."""
        if self._receiving is not None:
            torch._foreach_copy_(self._received, self._buffers)
            self._received_at, self._receiving = self._receiving, None

    def _start_fields(self, start_step: int) -> dict[str, Any]:
        """The metrics file's `start` record: one a segment (a requeued or restarted run appends another),
        with what `make report` needs to draw it: who ran, from where, at what peak."""
        device = self.ctx.device
        return {
            **start_fields(
                world_size=self.ctx.world_size,
                hosts=self.hosts,
                backend=self.ctx.backend,
                global_step=start_step,
                total_steps=self.total_steps,
            ),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            **self.mfu.start_fields(),
            "precision": precision(device, self.config.amp),  # of the matmuls: bf16, tf32 or fp32
            "bf16_grads": self.config.bf16_grads,
            "tokens_per_sample": self.task.tokens_per_sample,
            "config": self.config.to_dict(),
        }

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW fused (one kernel over all parameters) where every parameter allows it; SGD as torch
        defaults it. Measured in the trainer on the seed workload (2 ranks, bench_train.py's tutorial
        part, interleaved rounds): fused AdamW 59.6k samples/s against 54.1k per tensor; SGD 65.0k per
        tensor against 57.8k fused, whose grouping of tensors costs more than one small update saves."""
        params, cfg = self.trained, self.config
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) or None
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)

    def _lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (from 0): a pure function of the step, so a
        resumed run needs no scheduler state, and setting it costs no scheduler call per step."""
        return self.config.lr * self._lr_factor(step)

    def _lr_factor(self, step: int) -> float:
        warmup = self.config.warmup_steps
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    # ------------------------------------------------------------------ snapshots

    def _state(self, rng_all: list[dict[str, Any]]) -> Snapshot:
        return Snapshot(
            model=self.module.state_dict(),
            optimizer=self.optimizer.state_dict(),
            epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
            global_step=self.global_step,
            rng=rng_all,
            world_size=self.ctx.world_size,
            config=self.config.to_dict(),
        )

    def snapshot(self, durable: bool = False) -> None:
        """Collective: every rank hands rank 0 its RNG state; rank 0 copies the state to host memory
        and writes it in the background, so training is held only for the copy. `durable` (a stop,
        the end of training) waits until the newest snapshot is on disk."""
        if not self.config.snapshot_dir:
            return
        if self.recovery is not None:
            self.recovery.relax()  # the other ranks wait in their next collective for rank 0's copy
        rng_all, held_since = None, time.monotonic()
        if self.last_snapshot_step != self.global_step:
            # Timed, as every collective is: a peer frozen before the gather is a hang. Were it counted as
            # progress, the ranks waiting here would look busy to the watchdog for as long as they wait.
            self.progress.enter(Phase.SNAPSHOT_GATHER)
            if self._die_in_snapshot is not None and self._die_in_snapshot.exists():
                os.kill(os.getpid(), signal.SIGKILL)  # DIE_IN_SNAPSHOT (tests only)
            rng_all = gather_objects(_rng_state(self.ctx.device), self.ctx)
        self.progress.enter_counted(Phase.SNAPSHOT)  # from here on local and maybe long: the copy, a durable write
        if rng_all is not None:
            if self.writer is not None:
                self.writer.submit(self._state(rng_all), held_since)
            self.last_snapshot_step = self.global_step
        if durable and self.writer is not None:
            self.writer.wait()
        self.progress.enter_counted(Phase.STEP_END)

    def _snapshot_written(self, written: Written) -> None:
        """On the writer's thread, once a snapshot is durable."""
        self.log(
            f"snapshot saved: {written.path} (step {written.global_step}, training held {written.stall_s:.2f}s, written in {written.write_s:.2f}s)"
        )
        self.metrics.write(
            "snapshot",
            global_step=written.global_step,
            path=str(written.path),
            stall_s=round(written.stall_s, 4),
            write_s=round(written.write_s, 4),
        )

    def _land_snapshot_in_flight(self) -> None:
        """Training failed: an earlier step's snapshot still being written is worth finishing (less
        to replay on the retry); its own failure is reported, never raised over the first one."""
        if self.writer is None or not self.writer.in_flight:
            return
        try:
            self.writer.wait()
        except Exception as exc:
            self.log(f"warning: the snapshot being written when training failed was not saved: {first_line(exc)}")

    def restore(self) -> None:
        """Rank 0 picks the newest readable snapshot and sends it to every rank."""
        snapshot = None
        if self.store is not None:
            snapshot, path, reports = self.store.load_latest(Path(self.config.metrics_file) if self.config.metrics_file else None)
            for report in reports:
                self.log(report)
            if path is None:
                self.log(f"no readable snapshot in {self.store.directory}; starting from step 0")
            else:
                self.log(f"resuming from {path}")
        if not self.config.snapshot_dir:
            return
        snapshot = broadcast_from_main(snapshot, self.ctx, allowed=[Snapshot])
        if snapshot is not None:
            self._load_state(snapshot)

    def _load_state(self, snapshot: Snapshot) -> None:
        try:
            self.module.load_state_dict(snapshot.model)
            self.optimizer.load_state_dict(snapshot.optimizer)
        except (RuntimeError, ValueError, KeyError) as exc:  # every rank has this snapshot: bad input, not a failed collective
            raise SnapshotMismatch(
                f"the snapshot at global step {snapshot.global_step} in {self.config.snapshot_dir} does not fit this model "
                f"({first_line(exc)}): the model changed since it was written; start a new run with its own --snapshot-dir "
                "(a new run folder), or restore the model that wrote it"
            ) from None
        self.epoch, self.step_in_epoch, self.global_step = snapshot.epoch, snapshot.step_in_epoch, snapshot.global_step
        self.last_snapshot_step = self.global_step
        # A setting the snapshot predates (absent from its config) cannot differ.
        saved = snapshot.config
        changed = [k for k in Config.trajectory_fields() if k in saved and saved[k] != getattr(self.config, k)]
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {getattr(self.config, k)}" for k in changed)
            if not self.config.allow_changed_settings:
                raise SnapshotMismatch(
                    f"the snapshot at global step {snapshot.global_step} in {self.config.snapshot_dir} belongs to a run with other settings "
                    f"({diff}); to start a new run give it its own --snapshot-dir (a new run directory), or pass "
                    f"--allow-changed-settings to continue that run with these settings"
                )
            self.log(f"warning: continuing with changed settings ({diff}); the run will not match an uninterrupted one", main_only=True)
        saved_world = snapshot.world_size
        if saved_world != self.ctx.world_size:
            # Keep the samples already seen this epoch: map the position onto the new world size.
            seen = self.step_in_epoch * self.config.grad_accum * self.config.batch_size * saved_world
            self.step_in_epoch = min(self.steps_per_epoch, seen // (self.config.grad_accum * self.config.batch_size * self.ctx.world_size))
            self.log(
                f"warning: snapshot was written by {saved_world} ranks, now {self.ctx.world_size}: "
                f"resuming at step {self.step_in_epoch} of epoch {self.epoch + 1}; not bit-exact",
                main_only=True,
            )
        _set_rng_state(snapshot.rng[self.ctx.rank % len(snapshot.rng)], self.ctx.device)
        self.log(f"resumed after {self._position()}", main_only=True)

    # ------------------------------------------------------------------ one step

    def _train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, int, torch.Tensor | None, float]:
        """One optimizer step over `grad_accum` micro-batches; gradients sync only on the last, then
        are clipped (--clip-grad-norm). Returns the mean loss, the samples seen, the norm before
        clipping (tensors that stay on the device: read later, at a progress line, no host sync) and the
        seconds spent waiting for the all-reduce.
        Kept lean: at the seed workload's ~1 ms a step, and on an eager GPT on a GPU, whose step the host's
        launches set, each extra tensor op or Python call on this path shows in the step time (bench/bench_host.py
        counts them). Gradients are zeroed in place at the step's start, in one call, not set to None: they are
        views of DDP's buckets, so backward accumulates straight into the buckets instead of allocating new
        gradients that DDP copies in (~8% of the seed workload's step); and the stop flags' gradient, in a
        bucket too, is read between steps."""
        count = len(micro_batches)
        losses = []
        samples = 0
        progress = self.progress
        self.model.zero_grads()
        for i, (inputs, targets) in enumerate(micro_batches):
            synced = i == count - 1
            with nullcontext() if synced else self.model.no_sync():
                progress.enter(Phase.FORWARD)
                with self.autocast():
                    outputs = self.model(inputs)
                    loss = self.task.loss_fn(outputs, targets)
                scaled = loss / count if count > 1 else loss
                progress.enter(Phase.BACKWARD)
                self.model.backward(scaled, syncs=synced)
            losses.append(loss.detach())
            samples += len(inputs)
        progress.enter(Phase.SYNC)
        waited = time.perf_counter()
        self.model.finish()
        waited = time.perf_counter() - waited
        progress.enter(Phase.OPTIMIZER)
        grad_norm = None
        if self.config.clip_grad_norm is not None:
            # In place on the synced gradients (views of DDP's buckets), identical on every rank.
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trained, self.config.clip_grad_norm, foreach=True)
        lr = self._lr(self.global_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return (losses[0] if count == 1 else torch.stack(losses).mean()), samples, grad_norm, waited

    # ------------------------------------------------------------------ the loop

    def fit(self) -> Result:
        cfg = self.config
        replacing = self.recovery is not None and self.recovery.replacing
        # A standby that took rank 0's place (the store task serves the store) keeps the run's segment: no `start`
        # record, and no peak measured while the survivors wait for its state (MFU is not reported after it).
        if self.ctx.is_main and not replacing:
            preflight = Path(cfg.metrics_file).parent / run_folder.PREFLIGHT if cfg.metrics_file else None
            self.mfu.find_peak(self.ctx.device, cfg.amp, preflight, lambda: matmul_gflops(self.ctx, CPU_MEASURE_S))
        if replacing:
            self._take_state()
        else:
            self.restore()
            self.last_progress_step = self.global_step
        self.window = Window()
        start_step, started = self.global_step, time.monotonic()
        if not replacing:
            self.metrics.opening("start", lambda: self._start_fields(start_step))
        if self.global_step >= self.total_steps:
            self.log(f"training already complete at global step {self.global_step}; nothing to do", main_only=True)
        self.model.train()
        try:
            last_loss = self._loop_recovering(start_step, started)
        except BaseException:
            self._land_snapshot_in_flight()
            raise
        self.progress.enter(Phase.FINISH)
        # DDP hands every rank rank 0's buffers before each forward, so after the last one each rank
        # still holds its own (BatchNorm's running statistics): rank 0's are the run's, as in every snapshot.
        broadcast_buffers(self.module, self.ctx)
        self.snapshot(durable=True)
        elapsed = max(time.monotonic() - started, 1e-9)
        steps = self.global_step - start_step
        checksum = self._agree_on_checksum()
        samples_per_s = steps * cfg.grad_accum * cfg.batch_size * self.ctx.world_size / elapsed
        return Result(
            global_step=self.global_step, final_loss=last_loss, checksum=checksum, steps_per_s=steps / elapsed, samples_per_s=samples_per_s
        )

    def _loop_recovering(self, start_step: int, started: float) -> float | None:
        """The loop; under --recovery a failed collective is recovered from in this process (the survivors
        re-form the group with a standby in the dead rank's place) and the interrupted step is redone."""
        recovered_loss: float | None = None
        while True:
            try:
                if self.last_progress_step < self.global_step and self._progress_due():
                    # After a recovery (`_take_state` agreed where the last line was): the line the death interrupted, of
                    # the step the state was taken at, from the windows the survivors kept (a replacement brings none).
                    recovered_loss = self._progress(start_step, started)
                loss = self._loop(start_step, started)
                return loss if loss is not None else recovered_loss
            except RuntimeError as exc:  # gloo and NCCL report a dead peer as RuntimeError subclasses
                if self.recovery is None or not collective_failure(exc):
                    raise  # this rank's own error (an OOM, a failed snapshot write) ends it with its own reason
                self.recovery.recover(exc, self.log)  # or RecoveryImpossible: the job restarts every rank
                self._bind(self.ctx)
                if self.recovery.hosts_changed is not None:
                    self.recovery.hosts_changed(self.hosts)  # the standby's host now stands for the dead rank's
                self._take_state()
                self.model.train()

    def _take_state(self) -> None:
        """Collective, on a new group: every rank takes the state of the rank whose confirmed step is the greatest
        (`state_source`: a survivor whose all-reduce completed before the death is a step ahead of one whose did not; a
        replacement has none). Model, optimizer and position travel from it; the buffers are rank 0's at that step,
        from rank 0 or, when it died, from a survivor that received them (`buffer_holder`); the RNG is derived from
        the position (train.recovery.reseed)."""
        replacing = self.recovery is not None and self.recovery.replacing
        if self.config.cpu_bind == "auto" and (bound := bind_replacement(self.ctx, replacing)) is not None:
            self.log(f"standby took rank {self.ctx.rank}'s place on cpus {cpu_list(bound)}, left free by the rank it replaces")
        # With each position (global_step counts confirmed steps only: the optimizer of a step runs once its sync
        # completed on this rank), the survivors' timeline of this recovery: the standby that took rank 0's place writes
        # its record (rank 0's duty), and only the survivors saw the collective fail.
        self._receiving = None  # a step whose first forward never ran (its broadcast failed) keeps nothing from a later one
        mine = (-1, -1, -1, -1) if replacing else (self.global_step, self.last_snapshot_step, self._received_at, self.last_progress_step)
        gathered = gather_objects((mine, self.recovery.timeline() if self.recovery is not None else None), self.ctx)
        positions = [position for position, _ in gathered]
        source = state_source([step for step, *_ in positions])
        self.last_snapshot_step = positions[source][1]  # the same on every rank: whether a snapshot is due is agreed
        # Where the last progress line is, agreed alike: rank 0 writes the lines, so its word where it survived; else the
        # furthest survivor's (a line whose all-reduce completed but which the dead rank 0 had not yet written is lost).
        rank_0_survived = positions[0][0] >= 0
        self.last_progress_step = positions[0][3] if rank_0_survived else max(position[3] for position in positions)
        holder = buffer_holder([position[2] for position in positions], positions[source][0], rank_0_survived=rank_0_survived)
        if holder is None and any(isinstance(m, _NormBase) and m.track_running_stats for m in self.module.modules()):
            # Every rank knows this from the same gather and falls back alike: never a recovery that is not exact.
            raise RecoveryImpossible(
                "rank 0 died between a step's forward and the next step's buffer broadcast: the model's buffers "
                "(BatchNorm statistics) after that step, the run's own, existed only on it"
            )
        boundary = self._boundary_buffers(received=holder[1]) if holder is not None and holder[0] == self.ctx.rank else None
        self._settle_buckets()  # moves the buffers (taken above) and leaves gradients that the redone step zeroes
        mine = self._state([]) if self.ctx.rank == source else None
        state: Snapshot = broadcast_objects(mine, self.ctx, src=source, map_location=self.ctx.device, allowed=[Snapshot])
        if self.ctx.rank != source:
            self.module.load_state_dict(state.model)
            self.optimizer.load_state_dict(state.optimizer)
            self.epoch, self.step_in_epoch, self.global_step = state.epoch, state.step_in_epoch, state.global_step
        if holder is not None:  # else no buffer moves: the source's, loaded with its model, are everyone's
            if boundary:  # none where the model has no buffers
                torch._foreach_copy_(self._buffers, boundary)
            broadcast_buffers(self.module, self.ctx, src=holder[0])
        if replacing:
            self.log(f"standby took rank {self.ctx.rank}: state of rank {source} at {self._position()}")
            # Timed from here on, as a rank is after its first step: its module has run forward and backward (the settling
            # step above, compiled there where the run compiles), so nothing first-time is left. Left untimed until its own
            # first step ended, a replacement stuck in the redone step counted as making progress (train.watchdog), and
            # hid the whole recovered world from the watchdog until the collective timeout.
            self.progress.step_done(self.global_step)
        if self.recovery is not None:
            self.recovery.took_state(gathered[source][1])
        every = self.config.snapshot_every
        if (
            self.config.snapshot_dir
            and every
            and self.global_step
            and self.global_step % every == 0
            and self.last_snapshot_step != self.global_step
        ):
            # The death came in this step's snapshot (its gather) or before it was taken: take it now, not at the next
            # interval, and say so (a snapshot skipped in silence is one a restart misses). Here, so that every rank of
            # the new group takes it, the replacement too: taken by the survivors alone, its gather waited on a standby
            # that had gone on to the next step (seen on the test cluster: the recovered world stuck, its ranks waiting).
            self.log(f"snapshot at global step {self.global_step} was interrupted by the death: taking it now", main_only=True)
            self.snapshot()

    def _settle_buckets(self) -> None:
        """Collective, on a new group, before the state arrives: one forward and backward of no consequence (a loss
        times zero, no optimizer), so that the redone step syncs its gradients in the buckets the run had. A new DDP
        syncs its first step in one bucket of every gradient and lays out its buckets from the second step on (in the
        order backward made the gradients ready, rank 0's layout sent to all); the buckets decide how a gradient's sum
        is taken (an exchanged bucket is summed in rank order, an all-reduced one around the ring from a place set by
        its offset), so past two ranks a redone step summed in one bucket differs from the uninterrupted run's in the
        last bits. After this step the redone step's forward lays the buckets out as the run's were."""
        data = self.task.train_data
        inputs, targets = default_collate([data[i] for i in range(min(len(data), self.config.batch_size))])
        self.model.zero_grads()
        with self.autocast():
            loss = self.task.loss_fn(self.model(inputs.to(self.ctx.device)), targets.to(self.ctx.device))
        self.model.backward(loss * 0, syncs=True)
        self.model.finish()

    def _boundary_buffers(self, *, received: bool) -> list[torch.Tensor]:
        """On the rank `buffer_holder` names: the run's buffers after the source's confirmed steps, taken before
        `_settle_buckets`' forward moves its own: the copy received at the source's step's first forward (itself: nothing
        writes it before the next step's first forward), or (rank 0 that had not begun that step's forward) a copy of its own."""
        return self._received if received else [b.clone() for b in self._buffers]

    def _recovered(self, generation: int, times: dict[str, float]) -> None:
        """The first step after a recovery finished: its timeline, on rank 0's metrics and log, the record first: the job
        program reads it on the line (`hosts`, the ranks' hosts now: a node whose ranks all moved to a spare's standbys
        trains no more, enroot/ddpack_training.py `Training.follow_recovery`)."""
        step = self.global_step + 1  # this step, counted once it is done (the loop counts it next)
        self.metrics.write("recovery", global_step=step, generation=generation, hosts=self.hosts, **times)
        self.log(
            f"recovery: trained global step {step} in generation {generation}, "
            f"{times['total_s']:.3f}s after the failed collective (decision {times['decide_s']:.3f}s, abort {times['abort_s']:.3f}s, "
            f"new group {times['new_group_s']:.3f}s, state {times['state_s']:.3f}s, first step {times['first_step_s']:.3f}s)",
            main_only=True,
        )

    def position(self) -> dict[str, int]:
        """Where training stands, numbered as the progress lines number it (epochs from 1), in the end
        record's fields. Between epochs it names the end of the one just finished (`epoch 2/2 step
        29/29`), never the start of one that does not exist (`epoch 3/2 step 0/29`)."""
        epoch, step = self.epoch + 1, self.step_in_epoch
        if step == 0 and self.epoch > 0:
            epoch, step = self.epoch, self.steps_per_epoch
        return {
            "epoch": epoch,
            "step_in_epoch": step,
            "steps_per_epoch": self.steps_per_epoch,
            "global_step": self.global_step,
            "total_steps": self.total_steps,
        }

    def _position(self) -> str:
        at = self.position()
        return (
            f"epoch {at['epoch']}/{self.config.epochs} step {at['step_in_epoch']}/{at['steps_per_epoch']} "
            f"(global {at['global_step']}/{at['total_steps']})"
        )

    def _progress(self, start_step: int, started: float) -> float:
        """Collective, every --log-every steps: mean loss over ranks, global throughput and MFU, and every
        rank's step times over the window since the last line, all in the one all-reduce a progress line needs
        anyway; rank 0 prints and records them. A new window starts."""
        self.progress.enter(Phase.METRICS)
        if self._die_in_progress is not None and self._die_in_progress.exists():
            os.kill(os.getpid(), signal.SIGKILL)  # DIE_IN_PROGRESS (tests only)
        window = self.window
        window_s = max(time.monotonic() - window.started, 1e-9)
        mine = RankTimes.slots(self.ctx.rank, self.ctx.world_size, window_s, window.data_s, window.sync_s)
        losses = torch.stack(window.losses).sum() if window.losses else torch.zeros((), device=self.ctx.device)  # a replacement's
        totals = sum_over_ranks(losses, [len(window.losses), window.samples, *mine], self.ctx)
        loss_sum, steps, samples = totals[:3]
        times = RankTimes.from_sums(totals[3:], len(window.losses))
        loss = loss_sum / max(steps, 1)
        samples_per_s = samples / window_s
        rate = (self.global_step - start_step) / max(time.monotonic() - started, 1e-9)
        eta = (self.total_steps - self.global_step) / rate if rate > 0 else 0.0
        lr = self._lr(self.global_step)  # the next step's, as a scheduler reports it
        # The same on every rank (the gradients were synced): no collective needed.
        grad_norm = torch.stack(window.grad_norms).mean().item() if window.grad_norms else None
        rates: dict[str, float] = {}
        if self.task.tokens_per_sample:
            rates["tokens_per_s"] = samples_per_s * self.task.tokens_per_sample
        if (used := self.mfu.of(samples_per_s, self.ctx.world_size)) is not None:
            rates["mfu"] = used
        if self.ctx.is_main:
            norm = f" grad_norm {grad_norm:.4g}" if grad_norm is not None else ""
            tokens = f" tokens/s {rates['tokens_per_s']:,.0f}" if "tokens_per_s" in rates else ""
            used = f" mfu {format_share(rates['mfu'])}" if "mfu" in rates else ""
            slow = self.slow_ranks.judge(totals[3:], len(window.losses))
            self.log(
                f"{self._position()} loss {loss:.5f}{norm} lr {lr:.2e} samples/s {samples_per_s:,.0f}{tokens}{used} "
                f"eta {format_duration(eta)}" + (f"; {slow}" if slow else "")
            )
        self.metrics.write(
            "progress",
            epoch=self.epoch,
            step=self.step_in_epoch,
            global_step=self.global_step,
            loss=loss,
            lr=lr,
            **({"grad_norm": grad_norm} if grad_norm is not None else {}),
            samples_per_s=samples_per_s,
            **rates,
            eta_s=eta,
            **times.fields(),
        )
        self.last_progress_step, self.window = self.global_step, Window()
        return loss

    def _progress_due(self) -> bool:
        """Whether the step just counted gets a progress line: every --log-every steps, and the last."""
        return self.global_step % self.config.log_every == 0 or self.global_step >= self.total_steps

    def _loop(self, start_step: int, started: float) -> float | None:
        """Steps until the last one (or an agreed stop, raised); the mean loss of the last progress window."""
        cfg = self.config
        last_loss: float | None = None
        try:
            while self.global_step < self.total_steps:
                stream = self.batches.epoch(self.epoch, self.step_in_epoch * cfg.grad_accum)
                for step in range(self.step_in_epoch, self.steps_per_epoch):
                    count = min(cfg.grad_accum, self.batches_per_epoch - step * cfg.grad_accum)
                    self.progress.enter(Phase.DATA)
                    waited = time.perf_counter()
                    micro_batches = [next(stream) for _ in range(count)]
                    self.window.data_s += time.perf_counter() - waited
                    if not self.counted:
                        counting, self.counted = time.monotonic(), True
                        self.mfu.count(self.module, micro_batches[0], self.task.loss_fn, self.autocast)
                        self.window.started += time.monotonic() - counting  # not this rank's step time
                    if self.recovery is None:
                        self.window.add(*self._train_step(micro_batches))
                    else:
                        self.window.add(*self._recoverable_step(micro_batches))
                    self.global_step, self.step_in_epoch = self.global_step + 1, step + 1
                    self.progress.step_done(self.global_step)
                    done = self.global_step >= self.total_steps
                    if self._progress_due():
                        last_loss = self._progress(start_step, started)
                    agreed = self.model.agreed_stop()
                    if agreed is not None and not done:
                        self._stop(agreed)
                    if cfg.snapshot_every and self.global_step % cfg.snapshot_every == 0:
                        self.snapshot()
                    if done:
                        break
                if self.step_in_epoch >= self.steps_per_epoch:
                    self._end_epoch()
        except RuntimeError as exc:
            # A failure that says the settings do not fit the model (an unused parameter without
            # --find-unused-parameters, which DDP reports at the step after the first; a model torch
            # cannot compile) becomes one line naming what to change. The try costs nothing per step.
            raise explain_setup_failure(exc, self.model.ddp) or exc from None
        finally:
            self.batches.close()
        return last_loss

    def _recoverable_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, int, torch.Tensor | None, float]:
        """`_train_step` under --recovery (seeded from its position, timed for the collective timeout), and the
        timeline written after the first step of a recovery."""
        assert self.recovery is not None
        if self._buffers:
            self._receiving = self.global_step  # `_receive_buffers` keeps what this step's first forward receives
        if self._die_at is not None and self._die_at == (self.ctx.rank, self.global_step):
            self.model.sync.die_after_first_bucket = True
        done = self.recovery.step(self.config.seed, self.ctx.rank, self.global_step, lambda: self._train_step(micro_batches))
        if (times := self.recovery.finished()) is not None:
            self._recovered(self.recovery.generation, times)
        return done

    def _end_epoch(self) -> None:
        finished = self.epoch
        if self.recovery is not None:
            self.recovery.relax()  # the other ranks wait in their next collective for rank 0's eval
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        if self.ctx.is_main and self.task.eval_data is not None and self.task.metric is not None:
            self.progress.enter_counted(Phase.EVAL)
            self.module.eval()
            with torch.no_grad():
                inputs, targets = (t.to(self.ctx.device) for t in self.task.eval_data.tensors)
                results = self.task.metric(self.module(inputs), targets)
            self.module.train()
            self.log(f"epoch {finished + 1} done: " + " ".join(f"{k} {v:.4f}" for k, v in results.items()))
            self.metrics.write("eval", epoch=finished, global_step=self.global_step, **results)
            self.progress.enter_counted(Phase.STEP_END)
        if self.config.snapshot_every == 0:
            self.snapshot()

    def _stop(self, agreed: signal.Signals) -> None:
        """Every rank is here at the same step: snapshot, wait for the write, then leave together."""
        heard = "here" if self.watcher.received is not None else "by another rank"
        name = f"{agreed.name} (received {heard})"
        self.snapshot(durable=True)
        dist.barrier()
        where = self._position()
        written = self.writer.last if self.writer is not None else None
        path = str(written.path) if written is not None else None  # rank 0's; the writer exists only with a --snapshot-dir
        saved = f"snapshot {path}" if path else "snapshot written by rank 0"
        if not self.config.snapshot_dir:
            saved = "no snapshot (--snapshot-dir is empty)"
        raise Preempted(agreed.name, int(agreed), f"stopped on {name} at {where}; {saved}; rerun the same command to resume", path)

    def _agree_on_checksum(self) -> str:
        mine = parameter_checksum(self.module)
        everyone = gather_objects(mine, self.ctx)
        self.log(f"final parameter checksum {mine} at global step {self.global_step}")
        if len(set(everyone)) != 1:
            raise ChecksumMismatch(f"ranks disagree on the final parameters: {dict(enumerate(everyone))}")
        self.log(f"checksums agree across {self.ctx.world_size} ranks", main_only=True)
        return mine
