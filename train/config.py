"""Trainer flags -> a frozen Config. Every flag is documented in `python -m train --help`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NoReturn

from entrypoint.plan import BACKENDS, CPU_BIND_CHOICES  # one definition: the launcher checks them first
from train import run_folder

# Three minutes: steps of seconds are the norm even for large models, a recompile or a slow first
# batch of a new epoch takes tens of seconds, and the first step, snapshot writes and eval are not
# timed at all; a hang found in 3 minutes rather than at NCCL's 10 saves most of the idle allocation.
DEFAULT_HANG_TIMEOUT = 180.0
HANG_SHARE_OF_COLLECTIVE = 0.6


# Marks the settings that must match a snapshot's for a resumed run to continue the same trajectory.
TRAJECTORY = {"trajectory": True}


@dataclass(frozen=True)
class Config:
    task: str = field(metadata=TRAJECTORY)
    num_workers: int | None
    epochs: int
    batch_size: int = field(metadata=TRAJECTORY)
    lr: float = field(metadata=TRAJECTORY)
    optimizer: str = field(metadata=TRAJECTORY)
    momentum: float = field(metadata=TRAJECTORY)
    weight_decay: float = field(metadata=TRAJECTORY)
    lr_schedule: str = field(metadata=TRAJECTORY)
    warmup_steps: int = field(metadata=TRAJECTORY)
    seed: int = field(metadata=TRAJECTORY)
    data_seed: int = field(metadata=TRAJECTORY)
    dataset_size: int | None = field(metadata=TRAJECTORY)
    grad_accum: int = field(metadata=TRAJECTORY)
    amp: bool
    tf32: bool
    bf16_grads: bool
    clip_grad_norm: float | None = field(metadata=TRAJECTORY)
    sync_batchnorm: bool = field(metadata=TRAJECTORY)
    find_unused_parameters: bool
    compile: bool = field(metadata=TRAJECTORY)
    max_steps: int
    snapshot_dir: str
    snapshot_every: int
    keep_snapshots: int
    allow_changed_settings: bool
    log_every: int
    metrics_file: str | None
    tensorboard: str | None
    backend: str | None
    collective_timeout: float
    hang_timeout: float
    forensics_dir: str
    cpu_bind: str
    # In-process recovery (train/recovery.py): its per-step RNG is derived from the step, hence a trajectory setting.
    recovery: bool = field(default=False, metadata=TRAJECTORY)
    standby: bool = False
    standbys: int = 0  # the launcher's last this-many ranks are standbys (the templates' DDPACK_STANDBYS)
    bucket_cap_mb: float | None = None  # DDP's gradient buckets, MiB (None: train/step_path.py's for the device)
    store_task: bool = False  # the launcher's very last task serves the job's store, not rank 0 (DDPACK_STORE_TASK)

    @classmethod
    def trajectory_fields(cls) -> tuple[str, ...]:
        """The settings a resumed run must share with its snapshot (else train.trainer.SnapshotMismatch)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("trajectory"))

    def to_dict(self) -> dict:
        return asdict(self)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not >= 0")
    return value


def _standby_count(text: str) -> int:
    """--standbys K, or auto (the job settings' default, DDPACK_STANDBYS): 0 here, as the job's program resolves auto
    itself and hands each task the count it started (enroot/ddpack_training.py); a process started by hand has none."""
    return 0 if text == "auto" else _non_negative_int(text)


def _zero_or_one(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 or 1")
    return text == "1"


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not > 0")
    return value


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line and exit 2 (argparse prints its whole usage first, and under torchrun
    every rank would print it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m train",
        description=(
            "DDP trainer. Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from the environment "
            "(set by `entrypoint` or torchrun; a single process when unset). Resumes from the newest "
            "readable snapshot in --snapshot-dir; SIGTERM/SIGUSR1 on any rank stops all ranks at the "
            "same step with a snapshot."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    task = parser.add_argument_group("task")
    task.add_argument(
        "--task",
        default="regression",
        help="'regression' (20 features -> 1, MSE), 'classification' (MLP on a fixed random teacher, "
        "cross-entropy), or 'package.module:factory' for your own (factory(config) -> train.tasks.Task)",
    )
    task.add_argument(
        "--dataset-size", type=_positive_int, default=None, help="samples in the built-in tasks' data (task default when unset)"
    )
    task.add_argument("--data-seed", type=int, default=1234, help="seed of the built-in tasks' data and teacher")
    task.add_argument(
        "--num-workers",
        type=_non_negative_int,
        default=None,
        help="DataLoader worker processes per rank for datasets other than TensorDataset "
        "(default: the CPUs per rank less one, 1 to 8; 0 loads in the training process)",
    )

    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=_positive_int, default=10, help="passes over the data")
    opt.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per micro-batch")
    opt.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches accumulated per optimizer step")
    opt.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer")
    opt.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (--optimizer sgd)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")
    opt.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine", help="learning-rate schedule after warm-up")
    opt.add_argument("--warmup-steps", type=_non_negative_int, default=0, help="linear warm-up steps")
    opt.add_argument("--max-steps", type=_non_negative_int, default=0, help="stop after this many optimizer steps in all (0: no limit)")
    opt.add_argument("--seed", type=int, default=0, help="seed of model initialisation, shuffling and dropout")
    opt.add_argument("--amp", action="store_true", help="bfloat16 autocast (CUDA; also works on CPU)")
    opt.add_argument(
        "--no-tf32",
        dest="tf32",
        action="store_false",
        help="full fp32 matmuls and convolutions on Ampere and later GPUs (default: TF32 there, fp32 accumulation; no effect on CPUs)",
    )
    opt.add_argument(
        "--bf16-grads",
        action="store_true",
        help="send the gradients' all-reduce as bfloat16 (half the bytes; the sum too is bfloat16), typically with --amp; "
        "the gradients and the optimizer stay fp32",
    )
    opt.add_argument(
        "--clip-grad-norm",
        type=_positive_float,
        default=None,
        metavar="X",
        help="clip the gradients' total L2 norm to X after they are synced (the norm before clipping is shown in progress lines)",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="convert BatchNorm layers to SyncBatchNorm: statistics over the global batch (CUDA only, as torch implements it); "
        "without it each rank normalises with its own batch and rank 0's running statistics are kept",
    )
    model.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="for models whose forward leaves some parameters unused (a second head, a conditional branch): "
        "DDP then looks for them after every forward (costs a graph walk a step)",
    )
    model.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (inductor; needs a C++ compiler on CPU, which the images carry); the first steps compile",
    )

    state = parser.add_argument_group("snapshots and logs")
    state.add_argument(
        "--snapshot-dir",
        default=os.environ.get("DDPACK_SNAPSHOT_DIR", run_folder.SNAPSHOTS),
        help="where rank 0 writes snapshots and every run resumes from ('' disables); default $DDPACK_SNAPSHOT_DIR or ./snapshots",
    )
    state.add_argument(
        "--snapshot-every",
        type=_non_negative_int,
        default=100,
        help="optimizer steps between snapshots (0: only at epoch ends, stop and finish)",
    )
    state.add_argument("--keep-snapshots", type=_positive_int, default=2, help="snapshots kept (the newest N readable ones)")
    state.add_argument(
        "--allow-changed-settings",
        action="store_true",
        help="continue a snapshot whose trajectory settings (task, data, batch, optimizer, seed, ...) differ from these "
        "(default: refuse, since it is another run)",
    )
    state.add_argument("--log-every", type=_positive_int, default=10, help="optimizer steps between progress lines")
    state.add_argument(
        "--metrics-file",
        default=os.environ.get("DDPACK_METRICS_FILE") or None,
        help="JSON-lines metrics written by rank 0 (appended); default $DDPACK_METRICS_FILE (the templates set it), else none",
    )
    state.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=os.environ.get("DDPACK_TENSORBOARD_DIR") or None,
        help="also write the metrics' scalars as TensorBoard event files in DIR (rank 0); needs the tensorboard package, "
        "which the images do not carry (add it to your project's requirements.txt); default $DDPACK_TENSORBOARD_DIR, else none",
    )

    dist = parser.add_argument_group("distributed")
    dist.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get("DDPACK_BACKEND") or None,
        help="process-group backend (default: $DDPACK_BACKEND, else nccl with CUDA, else gloo)",
    )
    dist.add_argument(
        "--collective-timeout", type=_positive_float, default=300.0, help="seconds a collective may wait for a peer before the run fails"
    )
    dist.add_argument(
        "--hang-timeout",
        type=_non_negative_float,
        default=os.environ.get("DDPACK_HANG_TIMEOUT") or None,
        metavar="S",
        help="end the job (exit 124) with evidence in --forensics-dir when no rank finishes a step for S seconds; "
        "the first step, snapshot writes and eval are not timed; 0 disables (default: $DDPACK_HANG_TIMEOUT, else "
        f"{DEFAULT_HANG_TIMEOUT:g}, or {HANG_SHARE_OF_COLLECTIVE:g} x --collective-timeout when that is shorter, "
        "so that the watchdog sees a stuck collective before the collective's own timeout ends the run without evidence)",
    )
    dist.add_argument(
        "--forensics-dir",
        default=os.environ.get("DDPACK_FORENSICS_DIR", run_folder.FORENSICS),
        help="where a hang leaves every rank's stacks and the summary; default $DDPACK_FORENSICS_DIR or ./forensics",
    )
    dist.add_argument(
        "--cpu-bind",
        choices=CPU_BIND_CHOICES,
        default=os.environ.get("DDPACK_CPU_BIND") or "auto",
        help="auto: ranks that share one machine's CPUs each bind to a disjoint slice of them (see train/affinity.py); "
        "none: leave CPU placement to the OS and Slurm (default: $DDPACK_CPU_BIND, else auto)",
    )
    dist.add_argument(
        "--bucket-cap-mb",
        type=_positive_float,
        default=None,
        metavar="MB",
        help="DDP's gradient bucket size in MiB: smaller buckets start their all-reduce earlier in backward, larger ones "
        "make fewer collectives (default: 25 on CPU, every bucket; DDP's own on CUDA, 25 with a first bucket of 1)",
    )
    dist.add_argument(
        "--recovery",
        action="store_true",
        help="when a rank dies, the others keep their processes and a --standby process takes its place with the state of a "
        "survivor (docs/recovery.md); falls back to ending every rank, as without it, when it cannot",
    )
    dist.add_argument(
        "--standby",
        action="store_true",
        help="start warm (torch imported, model built) and wait to replace a rank that dies in a --recovery run of the same "
        "command and world size; implies --recovery",
    )
    dist.add_argument(
        "--standbys",
        type=_standby_count,
        default=os.environ.get("DDPACK_STANDBYS") or "auto",
        metavar="K",
        help="the launcher's last K processes are standbys (as --standby) and the others train in a world of WORLD_SIZE - K: "
        "how a job template starts them as extra tasks of its step; K > 0 implies --recovery (default: $DDPACK_STANDBYS, else "
        "auto: none, as the job's program hands the count it started and a process that sees auto has no standby beside it)",
    )
    dist.add_argument(
        "--store-task",
        type=_zero_or_one,
        default=os.environ.get("DDPACK_STORE_TASK") or "0",
        metavar="0|1",
        help="1: the launcher's last process (after the --standbys) serves the job's store and trains nothing, so that rank 0 "
        "is a client like any rank and its death is recovered in process too; implies --recovery (default: $DDPACK_STORE_TASK, "
        "which the job's program sets with its standbys, else 0: rank 0 hosts the store)",
    )
    return parser


def not_a_regular_file(path: str) -> str | None:
    """What `path` is when it exists and is no regular file (a directory, a device such as /dev/zero, a FIFO, a socket,
    followed through links), in a few words; None for a regular file or nothing there yet (created at the first
    record). Checked before training, on every rank: read back, /dev/zero would feed rank 0 zeros until the node's
    memory is gone, and a FIFO would block the first record until someone reads it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # not there yet (or not reachable: the first record names that error)
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (a named pipe)"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


# Tests only (tests/test_recovery_dist.py): `<rank>:<global step>` makes that rank SIGKILL itself between the first and
# the second gradient bucket of that step, under --recovery (train/grad_sync.py's DDPACK_TEST_DIE_IN_SYNC).
DIE_IN_SYNC = "DDPACK_TEST_DIE_IN_SYNC"


def death_in_sync(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """DIE_IN_SYNC's (rank, global step), or None when unset; ValueError naming what is expected (parse_config
    refuses it in one line before any rank starts)."""
    text = environ.get(DIE_IN_SYNC)
    if not text:
        return None
    rank, _, step = text.partition(":")
    if not (rank.isdigit() and step.isdigit()):
        raise ValueError(f"{DIE_IN_SYNC}={text!r} is not <rank>:<global step>; expected two numbers such as 1:12")
    return int(rank), int(step)


# Tests only (tests/test_recovery_dist.py), read under --recovery: `<rank>:<file>` makes that rank SIGKILL itself, once
# the file exists, as it enters the first progress line's all-reduce (DIE_IN_PROGRESS: a death that interrupts a
# progress line) or a snapshot's gather (DIE_IN_SNAPSHOT: a death that interrupts a snapshot).
DIE_IN_PROGRESS = "DDPACK_TEST_DIE_IN_PROGRESS"
DIE_IN_SNAPSHOT = "DDPACK_TEST_DIE_IN_SNAPSHOT"


def death_on_file(environ: Mapping[str, str], name: str, rank: int) -> Path | None:
    """The file of the test knob `name` (DIE_IN_PROGRESS, DIE_IN_SNAPSHOT) where it names `rank`, else None;
    ValueError naming what is expected (parse_config refuses it in one line before any rank starts)."""
    text = environ.get(name)
    if not text:
        return None
    named, _, path = text.partition(":")
    if not (named.isdigit() and path):
        raise ValueError(f"{name}={text!r} is not <rank>:<file>; expected such as 1:/tmp/die")
    return Path(path) if int(named) == rank else None


def parse_config(argv: Sequence[str] | None = None) -> Config:
    parser = build_parser()
    ns = parser.parse_args(argv)
    # argparse checks the choices of flags given, not of defaults taken from the environment.
    for name, variable, choices in (("backend", "DDPACK_BACKEND", BACKENDS), ("cpu_bind", "DDPACK_CPU_BIND", CPU_BIND_CHOICES)):
        value = getattr(ns, name)
        if value is not None and value not in choices:
            parser.exit(2, f"train: error: {variable}={value!r} is not one of {', '.join(choices)}; set it to one of them or unset it\n")
    if ns.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.exit(
            2,
            f"train: error: --tensorboard {ns.tensorboard} needs the tensorboard package, which this Python does not have; "
            "add tensorboard to your project's requirements.txt (make image APP=...) or pip install tensorboard\n",
        )
    if ns.metrics_file and (why := not_a_regular_file(ns.metrics_file)) is not None:
        parser.exit(
            2,
            f"train: error: --metrics-file {ns.metrics_file} is {why}, not a file: rank 0 appends a JSON line a record there "
            "and reads it back on a resume (a device never ends, a pipe blocks); name a regular file, or leave the flag out\n",
        )
    ns.recovery = ns.recovery or ns.standby or ns.standbys > 0 or ns.store_task
    if ns.recovery:  # the tests-only knobs are read under --recovery: a bad one is refused here, not as a traceback mid-run
        try:
            death_in_sync(os.environ)
            for knob in (DIE_IN_PROGRESS, DIE_IN_SNAPSHOT):
                death_on_file(os.environ, knob, 0)
        except ValueError as exc:
            parser.exit(2, f"train: error: {exc} (a tests-only setting); correct it or unset it\n")
    if ns.hang_timeout is None:
        ns.hang_timeout = min(DEFAULT_HANG_TIMEOUT, HANG_SHARE_OF_COLLECTIVE * ns.collective_timeout)
    elif ns.hang_timeout and ns.hang_timeout >= ns.collective_timeout:
        parser.exit(
            2,
            f"train: error: --hang-timeout {ns.hang_timeout:g} is not below --collective-timeout {ns.collective_timeout:g}, so a stuck "
            "collective would end the run before the watchdog collects evidence; lower it or raise --collective-timeout\n",
        )
    return Config(**{name.replace("-", "_"): value for name, value in vars(ns).items()})
