"""Preemption signals: remember that one arrived; the ranks then agree to stop at the same step.

The handler only sets a flag. Acting inside a handler would stop one rank mid-collective and hang
the others; instead the flag travels to every rank inside DDP's gradient sync
(`train.grad_sync`), and every rank stops at the same step boundary, so a signal that reaches a
single rank (one preempted node) still stops them all cleanly.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Installs handlers for SIGTERM (docker stop, Slurm, HyperPod) and SIGUSR1 (--signal=USR1@90)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
