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
  sent SIGTERM instead, at once. A child still running DDPACK_STOP_GRACE seconds after SIGUSR1 (default 60,
  inside `--signal=USR1@90`'s warning), or 20 s after SIGTERM (scancel, the time limit: Slurm's KillWait sends
  SIGKILL 30 s after it by default), is sent SIGABRT, which makes Python's faulthandler (PYTHONFAULTHANDLER,
  set here) print every thread's stack: a hung program's evidence, whatever it runs, without root or ptrace.
  Then SIGKILL. The child's stderr passes through this parent (to the job log as it comes) so that the stacks
  also land in the run folder's forensics (DDPACK_FORENSICS_DIR/rank-R.txt, as the hang watchdog names them).
- The exit status: the child's own, except that after a stop signal any ending but done-before-we-pushed (0),
  bad input (2) and a hang (124) is 128+N, so the step is requeued as preempted however the program ended.
- A program that recorded its end (ddpack_run's Run.done/exit_stopped/failed write it to DDPACK_END_FILE, a file
  in a private folder of this parent's) and then died of SIGABRT on its own, in torch's C++ teardown at exit
  (gloo's and TCPStore's threads: "terminate called without an active exception"), ends as it recorded: a
  finished run is not turned into a failure that the templates retry.

Standard library only: this is the launcher's world.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from entrypoint.atomic_file import write_atomically
from entrypoint.plan import seconds_up_to_an_hour

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
DEFAULT_STOP_GRACE_S = 60.0
TERM_GRACE_S = 20.0  # at most, after SIGTERM: inside Slurm's default KillWait (30 s), so the stacks come first
ABORT_WAIT_S = 5.0  # for faulthandler to write the stacks before SIGKILL
KEPT_CODES = (0, 2, 124)  # done, bad input, a hang the watchdog ended: not a preemption, whatever signal came
STDERR_KEPT = 1 << 20  # the last MiB of the child's stderr: where faulthandler's dump of every thread lands
ABORT_MARK = b"Fatal Python error: Aborted"
END_FILE_VAR = "DDPACK_END_FILE"  # where ddpack_run writes the program's end record (ddpack_run._record_end)


def stop_grace(environ: Mapping[str, str]) -> float:
    """DDPACK_STOP_GRACE, seconds a stopping program gets before its stacks are taken and it is killed."""
    text = environ.get("DDPACK_STOP_GRACE", "")
    if not text:
        return DEFAULT_STOP_GRACE_S
    value = seconds_up_to_an_hour(text)
    if value is None:
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


class StderrTail:
    """Copies the child's stderr to ours as it comes (one write per read) and keeps its last STDERR_KEPT bytes."""

    def __init__(self, pipe: int) -> None:
        self._pipe, self._kept = pipe, bytearray()
        self._thread = threading.Thread(target=self._copy, name="ddpack-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        while chunk := os.read(self._pipe, 65536):
            view = memoryview(chunk)
            while view:
                view = view[os.write(2, view) :]
            self._kept += chunk
            del self._kept[: max(0, len(self._kept) - STDERR_KEPT)]
        os.close(self._pipe)

    def stacks(self, wait_s: float = 2.0) -> str | None:
        """The last faulthandler dump, once the child is gone (its DataLoader workers may keep the pipe open:
        wait `wait_s` at most for the rest)."""
        self._thread.join(wait_s)
        at = self._kept.rfind(ABORT_MARK)
        return bytes(self._kept[at:]).decode(errors="replace") if at >= 0 else None


def save_stacks(stacks: str, env: Mapping[str, str], why: str) -> Path | None:
    """`stacks` as DDPACK_FORENSICS_DIR/rank-R.txt (written at once: atomic_file), or None where no folder is set or writable."""
    folder, rank = env.get("DDPACK_FORENSICS_DIR"), env.get("RANK", "0")
    if not folder:
        return None
    # As train/run_folder.py's rank_stacks() names it; the launcher never imports train (`python -m entrypoint` has
    # the working directory first on sys.path, where a user's train.py would run instead): tests check the names agree.
    path = Path(folder) / f"rank-{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, f"rank {rank} host {os.uname().nodename} pid {os.getpid()}: {why}\n\n{stacks}")
    except OSError:
        return None
    return path


def supervise(argv: Sequence[str], env: Mapping[str, str], grace_s: float) -> int:
    """Run `argv` as this rank's program and return the status the step should end with."""
    stops: list[signal.Signals] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stops.append(signal.Signals(signum))) for sig in STOP_SIGNALS}
    ends = tempfile.mkdtemp(prefix="ddpack-end-")  # private (0700): the child's end record, read after it exits
    end_file = Path(ends) / "end.json"
    child_env = {**env, "PYTHONFAULTHANDLER": env.get("PYTHONFAULTHANDLER") or "1", END_FILE_VAR: str(end_file)}
    try:
        child = subprocess.Popen(list(argv), env=child_env, preexec_fn=_ignore_usr1, stderr=subprocess.PIPE)
    except BaseException:
        shutil.rmtree(ends, ignore_errors=True)
        raise
    assert child.stderr is not None
    tail = StderrTail(os.dup(child.stderr.fileno()))
    child.stderr.close()
    passed_on: set[signal.Signals] = set()
    stop: signal.Signals | None = None
    pushed, deadline, aborted, allowed = False, float("inf"), False, grace_s
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
                    stop, allowed = sig, grace_s if sig == signal.SIGUSR1 else min(grace_s, TERM_GRACE_S)
                    deadline = time.monotonic() + allowed
                    print(
                        f"entrypoint: {sig.name} received; the program has {allowed:g} s to stop (DDPACK_STOP_GRACE)",
                        file=sys.stderr,
                        flush=True,
                    )
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
                        f"entrypoint: the program did not stop within {allowed:g} s of {stop.name}; its threads' stacks follow "
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
    if aborted and stop is not None and (stacks := tail.stacks()) is not None:
        why = f"did not stop within {allowed:g} s of {stop.name}; every thread's stack at SIGABRT (faulthandler)"
        if (saved := save_stacks(stacks, env, why)) is not None:
            print(f"entrypoint: the stacks are in {saved}", file=sys.stderr, flush=True)
    recorded = recorded_end(end_file)
    shutil.rmtree(ends, ignore_errors=True)
    if not aborted and returncode in (-int(signal.SIGABRT), 128 + int(signal.SIGABRT)) and recorded is not None:
        outcome, code = recorded
        print(
            f"entrypoint: the program recorded its end ({outcome}, exit {code}), then aborted on its way out (SIGABRT: "
            f"torch's teardown at exit); the step ends {code}, as it recorded",
            file=sys.stderr,
            flush=True,
        )
        returncode = code
    return exit_status(returncode, stop, pushed)


def recorded_end(path: Path) -> tuple[str, int] | None:
    """(outcome, exit code) of the end record the program wrote at DDPACK_END_FILE, None when it wrote none."""
    try:
        record = json.loads(path.read_text())
        return str(record["outcome"]), int(record["exit_code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
