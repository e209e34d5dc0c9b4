"""The built-in regression task with a gate in its data, for cluster tests that act on a job mid-run.

A test that signals, cancels, reads or takes a node from a running job must find it still running, however fast the
host trains. Waiting for N progress records and then acting is a race the job can win (it did on an idle CI machine:
the whole run ended before the test's USR1). So the test holds the job instead: with HOLD_AT=N and HOLD_UNTIL=PATH,
each process's N-th batch of this start (counting from 0) waits until PATH exists. The test acts while every rank
waits there, then opens the gate (testbed.slurm_jobs.Gate); a start that begins after the gate is open never waits.

A test that fails before it opens the gate leaves no job behind for long: a hold gives up after HOLD_MAX_S (900 s)
and training goes on to its end.

Run it with `--task held_task:regression_held --num-workers 0`: the batches are then fetched in the training process, so
the N-th batch is the N-th step of the start (DataLoader workers would each count their own). The test copies this
file into the job's submission folder (the trainer imports `--task` modules from there, in a container as on bare
metal), so it imports nothing of the test suite's. The framework projects (tests/frameworks/faults.py) hold their
training steps with the same `Hold`, imported from there.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from torch.utils.data import Dataset, TensorDataset

from train.config import Config
from train.tasks import Task, regression

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def say(line: str) -> None:
    """One line in one write: the ranks of a node share the step's output, and Python's print writes the line and
    its newline apart when unbuffered (torchrun's workers), so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Hold:
    """Counts a process's batches (or steps) and holds the `at`-th until `gate`, or this start's gate, exists.

    While it waits it says so, and says when a stop signal reaches it (the program's own handler still gets the
    signal): a test that signals a held job opens the gate only once every rank has the signal, so the signal is
    acted on at the next step, whatever Slurm's delivery takes."""

    def __init__(self, at: int, gate: Path, max_wait_s: float = 900.0) -> None:
        self.at, self.gate, self.count, self.max_wait_s = at, gate, 0, max_wait_s
        self.key = f"{os.environ.get('SLURM_RESTART_COUNT') or 0}.{os.environ.get('SLURM_STEP_ID') or 0}"
        self.this_start = gate.with_name(f"{gate.name}-{self.key}")

    @classmethod
    def from_environment(cls) -> Hold | None:
        at, gate = os.environ.get("HOLD_AT"), os.environ.get("HOLD_UNTIL")
        return cls(int(at), Path(gate), float(os.environ.get("HOLD_MAX_S") or 900)) if at and gate else None

    def is_open(self) -> bool:
        return self.gate.exists() or self.this_start.exists()

    def tick(self) -> None:
        """One more batch or step: the `at`-th waits for the gate."""
        if self.count == self.at and not self.is_open():
            self.wait()
        self.count += 1

    def wait(self) -> None:
        rank, arrived = os.environ.get("RANK", "0"), []
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def heard(signum: int, frame: FrameType | None) -> None:
            sig = signal.Signals(signum)
            arrived.append(sig.name)
            handler = previous[sig]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:  # what the signal would have done: end the process
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for sig in STOP_SIGNALS:
            signal.signal(sig, heard)
        say(f"held_task: rank {rank} held at batch {self.at} of start {self.key} until {self.this_start} exists")
        told, deadline = 0, time.monotonic() + self.max_wait_s
        try:
            while not self.is_open():
                for name in arrived[told:]:
                    say(f"held_task: rank {rank} got {name} while held in start {self.key}")
                told = len(arrived)
                if time.monotonic() > deadline:  # a test that failed before opening the gate: the job ends by itself
                    say(f"held_task: rank {rank} gave up waiting after {self.max_wait_s:g} s (HOLD_MAX_S); training on")
                    break
                time.sleep(0.05)
        finally:
            for sig, handler in previous.items():
                if handler is not None:  # None: a handler installed outside Python, which cannot be put back from here
                    signal.signal(sig, handler)


class HeldData(Dataset):
    """`data`, fetched batch by batch, each fetch one tick of `hold`."""

    def __init__(self, data: TensorDataset, hold: Hold) -> None:
        self.data, self.hold = data, hold

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.hold.tick()
        inputs, targets = (tensor[indices] for tensor in self.data.tensors)
        return list(zip(inputs, targets, strict=True))


def regression_held(config: Config) -> Task:
    """The regression task, its training data held as HOLD_AT and HOLD_UNTIL say (both unset: not held)."""
    task = regression(config)
    hold = Hold.from_environment()
    if hold is not None:
        task.train_data = HeldData(task.train_data, hold)  # type: ignore[arg-type]
    return task

