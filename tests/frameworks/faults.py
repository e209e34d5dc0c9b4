"""Faults the framework projects inject on request, from the environment (the same in every launch shape):
FREEZE_AT="RANK:N" blocks that rank forever inside its N-th training step of this start (counting from 0: a
hung rank in user code), on every start or, with FREEZE_ON_RESTART=K, only on the first start after the K-th
requeue (SLURM_RESTART_COUNT; a file in the working directory, the run folder, remembers that it froze, so a
restart of the step in the same allocation runs on); STEP_SLEEP_S slows every step; HOLD_AT and HOLD_UNTIL hold a
training step until the test opens a gate (testbed/held_task.py, which the test puts in the submission folder,
DDPACK_PROJECT_DIR), so a test can act on the run mid-training, however fast the host trains."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

_calls = 0
_hold = None


def _held() -> object | None:
    """The test's Hold (testbed/held_task.py, copied into the submission folder), when HOLD_AT asks for one."""
    global _hold
    if _hold is None and os.environ.get("HOLD_AT"):
        sys.path.append(os.environ["DDPACK_PROJECT_DIR"])
        _hold = importlib.import_module("held_task").Hold.from_environment()
    return _hold


def in_training_step(rank: int, global_step: int) -> None:
    global _calls
    calls, _calls = _calls, _calls + 1
    if hold := _held():
        hold.tick()  # type: ignore[attr-defined]
    if delay := float(os.environ.get("STEP_SLEEP_S", "0") or 0):
        time.sleep(delay)
    frozen, restart = os.environ.get("FREEZE_AT"), os.environ.get("FREEZE_ON_RESTART")
    if not frozen or (restart is not None and restart != os.environ.get("SLURM_RESTART_COUNT", "0")):
        return
    if (rank, calls) == tuple(int(part) for part in frozen.split(":")):
        if restart is not None:
            once = Path(f".faults-froze-rank-{rank}-after-restart-{restart}")
            if once.exists():
                return
            once.touch()
        print(f"rank {rank}: frozen in training_step at global step {global_step}", flush=True)
        while True:
            time.sleep(1)
