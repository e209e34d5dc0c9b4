"""Faults the framework projects inject on request, from the environment (the same in every launch shape):
FREEZE_AT="RANK:STEP" blocks that rank forever inside its training step at that global step (a hung rank in
user code); STEP_SLEEP_S slows every step (so a test can signal mid-training)."""

from __future__ import annotations

import os
import time


def in_training_step(rank: int, global_step: int) -> None:
    if delay := float(os.environ.get("STEP_SLEEP_S", "0") or 0):
        time.sleep(delay)
    frozen = os.environ.get("FREEZE_AT")
    if frozen and (rank, global_step) == tuple(int(part) for part in frozen.split(":")):
        print(f"rank {rank}: frozen in training_step at step {global_step}", flush=True)
        while True:
            time.sleep(1)
