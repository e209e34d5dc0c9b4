"""A user's own command (DDPACK_COMMAND, the image's APP_CMD) runs under a small parent that makes any program's
preemption end in a status the job templates requeue, bounded in time.

Why: the templates requeue a step that exits 128+N after SIGUSR1/SIGTERM (`--signal=USR1@90` gives 90 s), but a
program decides what it does with the signal. PyTorch Lightning, found under Slurm, handles SIGUSR1 by saving a
checkpoint inside the signal handler (a barrier that deadlocks when another rank sits in the next step's
collective) and by running `scontrol requeue`, which the image does not have; a program with no handler dies at
once without saving; one that deadlocks holds the job until its time limit, when the job script is killed too
and nothing requeues it.

What this parent does:
- The child starts with SIGUSR1 ignored. A program that installs its own handler (ddpack_run's adapters, a
  script that saves and exits 138) gets the signal as before; Lightning without an adapter installs none of its
  own over an existing disposition, so it cannot deadlock in one, and keeps training until told to stop.
- On SIGUSR1 or SIGTERM, a child that catches that signal gets it passed on (once: `docker stop` and a plain
  `kill` reach only this process; under Slurm, which signals every process of the step, the program may see
  it twice, so its handler should only note it, as ddpack_run's do), and a child that does not catch it is
  sent SIGTERM instead, at once. A child still running
  DDPACK_STOP_GRACE seconds later (default 60, inside the 90 s warning) is sent SIGABRT, which makes Python's
  faulthandler (PYTHONFAULTHANDLER, set here) print every thread's stack to the job log, then SIGKILL.
- The exit status: the child's own, except that after a stop signal any ending but done-before-we-pushed (0),
  bad input (2) and a hang (124) is 128+N, so the step is requeued as preempted however the program ended.

Standard library only: this is the launcher's world.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
DEFAULT_STOP_GRACE_S = 60.0
ABORT_WAIT_S = 5.0  # for faulthandler to write the stacks before SIGKILL
KEPT_CODES = (0, 2, 124)  # done, bad input, a hang the watchdog ended: not a preemption, whatever signal came


def stop_grace(environ: Mapping[str, str]) -> float:
    """DDPACK_STOP_GRACE, seconds a stopping program gets before its stacks are taken and it is killed."""
    text = environ.get("DDPACK_STOP_GRACE", "")
    if not text:
        return DEFAULT_STOP_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ValueError(f"DDPACK_STOP_GRACE={text!r} is not a number of seconds in (0, 3600]; set it to one or unset it")
    return value


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def exit_status(returncode: int, stop: signal.Signals | None, pushed: bool) -> int:
    """The step's status from the child's (`-N`: killed by signal N), the stop signal that came, and whether this
    parent had to push the child (SIGTERM on its behalf, or the abort): pushed, only bad input keeps its code."""
    code = 128 - returncode if returncode < 0 else returncode
    if stop is None:
        return code
    if code == 2 or (code in KEPT_CODES and not pushed):
        return code
    return 128 + int(stop)


def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def supervise(argv: Sequence[str], env: Mapping[str, str], grace_s: float) -> int:
    """Run `argv` as this rank's program and return the status the step should end with."""
    stops: list[signal.Signals] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signal.Signals(signum))) for sig in STOP_SIGNALS}
    child = subprocess.Popen(list(argv), env={**env, "PYTHONFAULTHANDLER": env.get("PYTHONFAULTHANDLER") or "1"}, preexec_fn=_ignore_usr1)
    passed_on: set[signal.Signals] = set()
    stop: signal.Signals | None = None
    pushed, deadline, aborted = False, float("inf"), False
    try:
        while True:
            try:
                returncode = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            while stops:
                sig = stops.pop(0)
                if stop is None:
                    stop, deadline = sig, time.monotonic() + grace_s
                    print(f"entrypoint: {sig.name} received; the program has {grace_s:g} s to stop (DDPACK_STOP_GRACE)", file=sys.stderr, flush=True)
                if sig in passed_on:
                    continue
                passed_on.add(sig)
                if catches(child.pid, sig):
                    child.send_signal(sig)
                else:
                    pushed = True
                    child.send_signal(signal.SIGTERM)  # it ignores or would die of `sig`: ask it to stop the usual way
            if stop is not None and time.monotonic() > deadline:
                pushed = True
                if not aborted:
                    print(
                        f"entrypoint: the program did not stop within {grace_s:g} s of {stop.name}; its threads' stacks follow "
                        f"(SIGABRT), then it is killed and the step ends {128 + int(stop)} to be requeued",
                        file=sys.stderr,
                        flush=True,
                    )
                    child.send_signal(signal.SIGABRT)
                    aborted, deadline = True, time.monotonic() + ABORT_WAIT_S
                else:
                    child.kill()
                    deadline = float("inf")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_status(returncode, stop, pushed)
