"""Preemption signals: remember that one arrived; the trainer's ranks then agree to stop together.

The handler only sets a flag. Acting inside a handler would stop one rank mid-collective and hang
the others; instead every rank checks the flag at each step boundary through an all-reduce
(`train.distributed.max_over_ranks`), so a signal that reaches a single rank still stops them all cleanly.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Installs handlers for SIGTERM (docker stop, Slurm, HyperPod) and SIGUSR1 (--signal=USR1@90)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.received: signal.Signals | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def signum(self) -> int:
        """The received signal's number, 0 while none has arrived."""
        return int(self.received) if self.received is not None else 0

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
