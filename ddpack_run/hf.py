"""Hugging Face `Trainer` (and `accelerate` underneath it) under ddpack: one callback, one resume argument.

    from ddpack_run.hf import DdpackCallback, last_checkpoint
    trainer = Trainer(..., callbacks=[DdpackCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

On a preemption signal (SIGUSR1 from `--signal=USR1@90`, SIGTERM) the ranks agree at a step boundary, the
Trainer saves its checkpoint there (model, optimizer, scheduler, RNG, `checkpoint-<step>` in output_dir, on
every rank's schedule), and the process exits 128+N, which the job template requeues; the next start resumes
from that checkpoint. Hangs end with every rank's stacks and a summary naming the rank that fell behind;
progress records go to the run folder's metrics.jsonl for `make report`, and each evaluation's metrics
(eval_loss, compute_metrics' own) as an eval record that `ddpack compare SWEEP --sort eval_loss` ranks by.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ddpack_run import Phase, Run, parameter_checksum

__all__ = ["DdpackCallback", "last_checkpoint"]


def last_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` folder in output_dir, or None (a first start): what to resume from."""
    try:
        return get_last_checkpoint(output_dir)
    except FileNotFoundError:
        return None


class DdpackCallback(TrainerCallback):
    """Agreed stop on preemption, hang watchdog and metrics records for a `transformers.Trainer`."""

    def __init__(self, **run_options: Any) -> None:
        self.run = Run(framework="transformers", **run_options)
        self._loss: float | None = None
        self._stopping = False
        self._hooks: list[Any] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        self.run.install_signal_handlers()  # over accelerate's or anyone's since this callback was made
        self.run.global_step = state.global_step
        self.run.total_steps = state.max_steps or None
        if model is not None:  # where forward ends and backward (with the gradients' all-reduce) begins
            self._hooks = [
                model.register_forward_pre_hook(lambda *_: self.run.phase(Phase.FORWARD)),
                model.register_forward_hook(lambda *_: self.run.phase(Phase.BACKWARD)),
            ]
        self.run.phase(Phase.DATA)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.run.phase(Phase.OPTIMIZER)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        if logs and isinstance(logs.get("loss"), (int, float)):
            self._loss = float(logs["loss"])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        loss, self._loss = self._loss, None
        if self.run.step_done(step=state.global_step, samples=samples, loss=loss):
            # Every rank agreed at this step: the Trainer saves here, on every rank, then on_save ends the process.
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._stopping:
            self.run.exit_stopped(os.path.abspath(os.path.join(args.output_dir, f"checkpoint-{state.global_step}")))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: dict[str, float] | None = None, **kwargs: Any
    ) -> None:
        """The Trainer's own evaluation results (eval_loss, and what compute_metrics returns, eval_ prefixed) as an
        eval record at this step: no user code."""
        self.run.eval_done(step=state.global_step, **{name: value for name, value in (metrics or {}).items() if name != "step"})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self.run.done(checksum=parameter_checksum(model) if model is not None else None)
