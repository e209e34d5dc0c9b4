"""PyTorch Lightning (and NeMo, built on it) under ddpack: one line in your script.

    from ddpack_run.lightning import DdpackCallback
    trainer = L.Trainer(..., callbacks=[DdpackCallback()])

What it changes:
- Preemption. Lightning's own SIGUSR1 handler saves a checkpoint from inside the signal handler (a barrier
  that deadlocks when another rank sits in the next step's collective) and runs `scontrol requeue`, which
  the image does not have; its SIGTERM handler broadcasts from inside the handler. This callback puts
  flag-only handlers in their place once training starts; the ranks agree at a step boundary, all save
  Lightning's HPC checkpoint (`hpc_ckpt_N.ckpt` in the trainer's default_root_dir, the run folder under
  the templates), and the process exits 128+N, which the template requeues. Under Slurm Lightning resumes
  from the newest HPC checkpoint by itself; elsewhere pass `ckpt_path=last_hpc_checkpoint(root)` to fit.
- Hangs: a rank that finishes no step for DDPACK_HANG_TIMEOUT seconds ends the job with every rank's stacks
  and a summary naming the rank that fell behind (stuck in training_step, in data loading, or frozen).
- Metrics: the run folder's metrics.jsonl gets the same start, progress, eval and end records as the bundled
  trainer's, so `make report` draws the run; each validation's `trainer.callback_metrics` (what `self.log`
  gave: val_loss, val_acc, ...) is an eval record, which `ddpack compare SWEEP --sort val_loss` ranks by.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from ddpack_run import Phase, Run, batch_size, parameter_checksum

__all__ = ["DdpackCallback", "last_hpc_checkpoint"]


def last_hpc_checkpoint(root: str | Path) -> str | None:
    """The newest `hpc_ckpt_N.ckpt` in `root` (what a preempted run saved), or None."""
    found = [(int(m.group(1)), p) for p in Path(root).glob("hpc_ckpt_*.ckpt") if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name))]
    return str(max(found)[1]) if found else None


class DdpackCallback(Callback):
    """Agreed stop on preemption, hang watchdog and metrics records for a Lightning Trainer."""

    def __init__(self, **run_options: Any) -> None:
        self.run = Run(framework="lightning", **run_options)
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registered its handlers just before this hook: ours go over them.
        self.run.install_signal_handlers()
        self.run.global_step = self._last_step = trainer.global_step
        if trainer.max_steps and trainer.max_steps > 0:
            self.run.total_steps = trainer.max_steps
        self.run.phase(Phase.DATA)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.run.phase(Phase.FORWARD)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.run.phase(Phase.BACKWARD)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.run.phase(Phase.OPTIMIZER)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # a micro-batch of gradient accumulation: no step yet
            self.run.phase(Phase.DATA)
            return
        self._last_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not self.run.step_done(step=trainer.global_step, samples=batch_size(batch), loss=loss):
            return
        # Every rank is here, at the same step: Lightning's checkpoint (a barrier, rank 0 writes) is safe now.
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path)
        self.run.exit_stopped(path)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's own validation results (what `self.log` gave, as `trainer.callback_metrics` holds them at the
        end of a validation) as an eval record at this step: no user code. The sanity check's two batches are no
        result and are left out."""
        if trainer.sanity_checking:
            return
        logged = {name: value for name, value in trainer.callback_metrics.items() if name != "step"}  # `step` places the record
        self.run.eval_done(step=trainer.global_step, **{**logged, "epoch": trainer.current_epoch})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.done(checksum=parameter_checksum(pl_module))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SystemExit):
            self.run.failed(f"{type(exception).__name__}: {exception}")
