"""ddpack's promises for a training loop that is not the bundled trainer: your own, Lightning's, Hugging Face's.

    import ddpack_run

    run = ddpack_run.Run()                      # after your process group is up, or before: it waits for it
    for batch in loader:
        ...                                     # forward, backward, optimizer step
        if run.step_done(samples=len(batch), loss=loss.item()):
            save_your_checkpoint()              # every rank is here, at the same step
            run.exit_stopped()                  # exits 128+N: the job templates requeue it
    run.eval_done(loss=val_loss, accuracy=acc)  # your evaluation: what `ddpack compare SWEEP --sort` ranks by
    run.done()

What it does, with the same machinery as `python -m train`:
- Preemption (SIGUSR1 from `--signal=USR1@90`, SIGTERM from scancel, `docker stop`, a time limit): the handler
  only notes the signal; the ranks agree at a step boundary (an all-reduce about once a second of training,
  never inside a signal handler), so a signal that reached one rank stops them all at the same step, and
  `step_done` returns True on every rank at once. Exit with `exit_stopped()` (128+N) and the templates requeue.
- Hangs: a heartbeat per rank through the rendezvous store; when no rank finishes a step for the hang timeout
  (DDPACK_HANG_TIMEOUT, 180 s; the first step is untimed), every live rank writes its stacks to the run
  folder's forensics (DDPACK_FORENSICS_DIR), one summary names the ranks that fell behind, and all exit 124.
- Metrics (rank 0, DDPACK_METRICS_FILE): a `start` record per segment, `progress` records with every rank's
  step, data and backward times, `eval` records of your evaluation's numbers (`eval_done`), and the `end`
  record, so `make report` draws the run and `ddpack compare` ranks it.

The adapters (`ddpack_run.lightning`, `ddpack_run.hf`) drive a Run from the frameworks' hooks. Runs inside the
container, beside `train/`; torch is imported when the process group is.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any


def _import_bundle_train() -> None:
    """Make `train` the bundle's package (beside this one) before importing from it. The most common name for
    a user's own script is train.py, and its folder comes first on sys.path: a plain `import train` there
    finds the user's script (and imports it a second time) instead of ddpack's trainer package."""
    folder = Path(__file__).resolve().parent.parent / "train"
    loaded = sys.modules.get("train")
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve().parent == folder:
        return
    spec = importlib.util.spec_from_file_location("train", folder / "__init__.py", submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ImportError(f"ddpack_run: the bundle's train package is not at {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train"] = module
    spec.loader.exec_module(module)


_import_bundle_train()

from entrypoint.plan import PlanError, job_token  # noqa: E402 - importable wherever train is (train.config imports it)
from train import run_folder  # noqa: E402
from train.config import DEFAULT_HANG_TIMEOUT  # noqa: E402
from train.metrics import MetricsFile, RankLog, start_fields  # noqa: E402 - after the bundle's train package is the one imported
from train.outcome import RunEnd  # noqa: E402
from train.perf import RankTimes, SlowRanks  # noqa: E402
from train.signals import PreemptionWatcher  # noqa: E402
from train.watchdog import EXIT_HANG, PHASES, Phase, Progress, Watchdog, start_watchdog  # noqa: E402

__all__ = ["EXIT_HANG", "Phase", "Run", "eval_number"]

# The ranks agree (stop flag, per-rank times) about this often: one small all-reduce (~1 ms on gloo between
# two local processes) a second of training costs about 0.1%, and a stop lands well inside SIGUSR1@90's warning.
AGREE_EVERY_S = 1.0
MAX_STEPS_BETWEEN_AGREEMENTS = 100


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        print(
            f"ddpack_run: error: {name}={text!r} is not a number of seconds >= 0; set it to one (0 turns the hang watchdog off) or unset it",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return value


def _check_job_token() -> None:
    """A malformed DDPACK_JOB_TOKEN is bad input, found before training (the launcher refuses it first; a
    program started by hand is not launched by it)."""
    try:
        job_token(os.environ)
    except PlanError as exc:
        print(f"ddpack_run: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


class Run:
    """One rank's view of the run; create one per process (after or before init_process_group).

    `max_steps_between`: steps between progress records and agreements at most (they happen about once a second
    anyway); `hang_timeout` (DDPACK_HANG_TIMEOUT): seconds without a finished step on every rank that make a
    hang, 0 turns the watchdog off; `metrics_file` (DDPACK_METRICS_FILE) and `forensics_dir`
    (DDPACK_FORENSICS_DIR, else ./forensics): where the records and a hang's evidence go; `framework`: a name
    for the start record; `start_step`: the step a resumed run continues from; `total_steps`: for the record."""

    def __init__(
        self,
        *,
        hang_timeout: float | None = None,
        metrics_file: str | None = None,
        forensics_dir: str | None = None,
        max_steps_between: int = MAX_STEPS_BETWEEN_AGREEMENTS,
        framework: str = "own loop",
        start_step: int = 0,
        total_steps: int | None = None,
    ) -> None:
        self.hang_timeout = _env_seconds("DDPACK_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT) if hang_timeout is None else hang_timeout
        _check_job_token()
        self.metrics_path = metrics_file if metrics_file is not None else os.environ.get("DDPACK_METRICS_FILE") or None
        self.forensics_dir = Path(forensics_dir or os.environ.get("DDPACK_FORENSICS_DIR") or run_folder.FORENSICS).absolute()
        self.max_steps_between, self.framework, self.total_steps = max(1, max_steps_between), framework, total_steps
        self.progress = Progress()
        self.watcher = PreemptionWatcher()
        self.rank, self.world_size, self.host = 0, 1, socket.gethostname()
        self.log = RankLog(0, 1)
        self.metrics = MetricsFile(None)
        self.global_step = start_step  # where this start resumed: the start record's position
        self.stop_signal: signal.Signals | None = None
        self._started = False
        self._watchdog: Watchdog | None = None
        self._slow: SlowRanks | None = None
        self._next_agreement = 1
        self._window = _Window()
        self._phase_at = time.perf_counter()
        self._ended = False

    # ------------------------------------------------------------ what the loop calls

    def install_signal_handlers(self) -> None:
        """(Re)install the flag-only SIGTERM/SIGUSR1 handlers over whatever a framework installed since:
        Lightning's own act inside the handler (a checkpoint's barrier, a broadcast) and can deadlock."""
        self.watcher.restore()
        self.watcher = PreemptionWatcher()

    def phase(self, name: str) -> None:
        """Where this rank is in its step, for the hang verdict and the per-rank times: Phase.DATA ("data", waiting
        for the next batch), Phase.FORWARD, Phase.BACKWARD (its gradients' all-reduce included), Phase.OPTIMIZER."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}; use ddpack_run.Phase's names")
        now = time.perf_counter()
        self._window.charge(self.progress.phase, now - self._phase_at)
        self._phase_at = now
        self.progress.enter(name)

    def step_done(self, *, step: int | None = None, samples: int | None = None, loss: Any = None) -> bool:
        """One optimizer step finished (`step`: the framework's global step, else counted here). True on every
        rank at once when the ranks agreed to stop (a preemption signal reached any of them): save, then
        `exit_stopped()`."""
        if not self._started:
            self._start()
        self.phase(Phase.DATA)
        self.global_step = step if step is not None else self.global_step + 1
        self.progress.step_done(self.global_step)
        self._window.step(samples, loss)
        if self.global_step >= self._next_agreement:
            self._agree()
        elif self.world_size == 1:  # nobody to agree with: a signal stops this rank at once
            self.stop_signal = self.watcher.received
        return self.stop_signal is not None

    def eval_done(self, loss: Any = None, *, step: int | None = None, **more: Any) -> dict[str, float]:
        """Your evaluation's results: one `eval` record (rank 0 writes it; call on every rank or on rank 0 alone) at
        `step` (default: the last finished step), with `loss` and every other named number (`accuracy=...`; a tensor
        of one value is read with .item()). `ddpack compare`, `ls --sort` and `export` rank runs by any of them.
        A value that is not one finite number (a string, a list, NaN) is left out: the record holds numbers only.
        Returns what it recorded."""
        if not self._started:
            self._start()
        results = {name: number for name, value in {"loss": loss, **more}.items() if (number := eval_number(value)) is not None}
        self.metrics.write("eval", global_step=self.global_step if step is None else int(step), **results)
        return results

    def exit_stopped(self, checkpoint: str | None = None) -> None:
        """After an agreed stop and your save: record the end and exit 128+N (138 for SIGUSR1, 143 for
        SIGTERM), which the templates requeue. `checkpoint`: what the next start resumes from, for the record."""
        assert self.stop_signal is not None, "exit_stopped() is for after step_done() returned True"
        code = 128 + int(self.stop_signal)
        resume = f"; resume from {checkpoint}" if checkpoint else ""
        self.log(f"stopped on {self.stop_signal.name} at global step {self.global_step}{resume}", main_only=True)
        self._end("stopped", code, signal=self.stop_signal.name, snapshot=checkpoint)
        raise SystemExit(code)

    def done(self, checksum: str | None = None) -> None:
        """Training finished: the end record (a done run is not requeued)."""
        self._end("done", 0, checksum=checksum)

    def failed(self, reason: str, exit_code: int = 1) -> None:
        """Training raised. A collective that failed because the peers left on a declared hang waits here
        for this rank's watchdog to end it as hung (exit 124, with its stacks), not as a second failure."""
        if self._watchdog is not None:
            self._watchdog.yield_to_a_declared_hang()
        self._end("failed", exit_code, reason=reason[:1000])

    # ------------------------------------------------------------ inside

    def _start(self) -> None:
        """At the first step: the process group is up by now (frameworks create it in their set-up)."""
        import torch.distributed as dist

        self._started = True
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.log = RankLog(self.rank, self.world_size)
        if self.rank == 0:
            self.metrics = MetricsFile(self.metrics_path)
        hosts = [self.host]
        if self.world_size > 1:
            hosts = [None] * self.world_size
            dist.all_gather_object(hosts, self.host)
        self._slow = SlowRanks([str(h) for h in hosts])
        backend = dist.get_backend() if self.world_size > 1 else None
        self.metrics.write(
            "start",
            **start_fields(
                world_size=self.world_size, hosts=hosts, backend=backend, global_step=self.global_step, total_steps=self.total_steps
            ),
            framework=self.framework,
        )
        if self.hang_timeout and self.world_size > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            self._watchdog = start_watchdog(
                self.progress,
                store_name="ddpack-run-watchdog",
                rank=self.rank,
                world_size=self.world_size,
                host=self.host,
                timeout_s=self.hang_timeout,
                forensics_dir=self.forensics_dir,
                log=self.log,
                rank_hosts=[str(h) for h in hosts],
                on_end=self._record_end,
            )

    def _agree(self) -> None:
        """One all-reduce of every rank's slots: its stop signal (0: none) and its times over the window. From
        the sums every rank reads the same verdict and the same next agreement step (from the slowest mean step)."""
        import torch
        import torch.distributed as dist

        window, self._window = self._window, _Window()
        self.progress.enter(Phase.SYNC)
        signalled = self.watcher.received
        codes = [0.0] * self.world_size
        codes[self.rank] = float(int(signalled)) if signalled is not None else 0.0
        slots = RankTimes.slots(self.rank, self.world_size, window.seconds(), window.data_s, window.backward_s)
        sums = torch.tensor([*codes, *slots], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(sums)
        self.progress.enter(Phase.DATA)
        values = [float(v) for v in sums]
        stop_codes, time_sums = [int(v) for v in values[: self.world_size] if v], values[self.world_size :]
        if stop_codes:
            self.stop_signal = signal.Signals(stop_codes[0])  # the lowest signalled rank's: every rank reads the same
        times = RankTimes.from_sums(time_sums, window.steps)
        every = max(1, min(self.max_steps_between, int(AGREE_EVERY_S / max(max(times.step_s), 1e-6))))
        self._next_agreement = self.global_step + every
        slow = self._slow.judge(time_sums, window.steps) if self._slow else None
        fields: dict[str, Any] = {"global_step": self.global_step, "steps": window.steps}
        if window.loss is not None:
            fields["loss"] = window.loss
        if window.samples:
            fields["samples_per_s"] = window.samples * self.world_size / max(window.seconds(), 1e-9)
        self.metrics.write("progress", **fields, **times.fields(), **({"slow": slow} if slow else {}))

    def _record_end(self, end: RunEnd) -> None:
        if self._ended:
            return
        self._ended = True
        self.log(end.line())
        self.metrics.write("end", **end.fields())
        self.metrics.close()
        if path := os.environ.get("DDPACK_END_FILE"):  # the launcher's (entrypoint/supervise.py): how this rank ended
            with contextlib.suppress(OSError):
                Path(path).write_text(json.dumps(end.fields()))

    def _end(self, outcome: str, exit_code: int, **extra: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self.watcher.restore()
        atexit.register(_destroy_process_group)
        self._record_end(
            RunEnd(
                rank=self.rank,
                world_size=self.world_size,
                host=self.host,
                outcome=outcome,
                exit_code=exit_code,
                global_step=self.global_step,
                **extra,
            )
        )


class _Window:
    """One agreement window's sums: steps, samples, the mean loss, seconds in data wait and in backward."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.steps = self.samples = 0
        self.data_s = self.backward_s = 0.0
        self._loss_sum: Any = 0.0
        self._losses = 0

    def charge(self, phase: str, seconds: float) -> None:
        if phase == "data":
            self.data_s += seconds
        elif phase == "backward":
            self.backward_s += seconds

    def step(self, samples: int | None, loss: Any) -> None:
        """`loss`: a float, or a tensor kept on its device (summed there: no host sync until the agreement)."""
        self.steps += 1
        self.samples += samples or 0
        if loss is not None:
            self._loss_sum = self._loss_sum + (loss.detach() if hasattr(loss, "detach") else float(loss))
            self._losses += 1

    def seconds(self) -> float:
        return time.perf_counter() - self.began

    @property
    def loss(self) -> float | None:
        if not self._losses:
            return None
        mean = float(self._loss_sum) / self._losses
        return mean if math.isfinite(mean) else None


def _destroy_process_group() -> None:
    """At interpreter exit, after a Run ended: a gloo process group still alive then can end the process with
    `terminate called without an active exception` (exit 134) once training is over (seen with the HF Trainer),
    which would turn a stop's 138 or a finish's 0 into a failure that the templates retry."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # leaving anyway: a peer may be gone already
        pass


def eval_number(value: Any) -> float | int | None:
    """A metric as the eval record holds it: an int or a finite float (a one-value tensor or numpy scalar read
    with .item()), else None (left out). A bool is no metric."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # a tensor of more than one value
            return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def batch_size(batch: Any) -> int | None:
    """The leading dimension of a batch's first tensor (a tensor, or one in a tuple, list or dict), or None."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else None


def parameter_checksum(module: Any) -> str:
    """SHA-256 (first 16 hex digits) over the parameters, in order: equal on every rank of a DDP run (buffers
    such as BatchNorm's running statistics are each rank's own after the last step, so they are left out)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in module.named_parameters():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
