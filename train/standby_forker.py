"""New standbys for the store task, forked from a process that has already paid for a standby's start.

A standby started cold imports torch and the trainer (about 2 s of CPU here), then its first DDP construction imports
torch._dynamo (about 2 s more; `train.recovery.warm_up`). After a recovery the store task started one that way, on
its node, while the recovered world trained there: on the test cluster's 2 CPUs those 4 s of CPU took a fifth of the
ranks' CPU over the ~600 steps after a recovery (0.74x an uninterrupted run's samples/s). So the store task forks one
process (`StandbyForker`) before it serves the job's store. It has the trainer imported already (the store task is
`python -m train`); it imports torch._dynamo at once, at the job's start, while the ranks start (2 s of one core, once
a job, where they import the same), and then forks each new standby from that state on request: the standby is
watching about 0.3 s after the decision that consumed the last one, at about 0.2 s of CPU (its own warm-up, every
module loaded), and nothing of it falls in the steps after a recovery. (A warm-up at the lowest priority instead, in a
thread, was tried: on the test cluster's saturated CPUs it was often not done when the first rank died, and that
standby then started cold.)

Why a fork is safe here: the forker is forked before the store's server starts its threads, and it only imports (no
process group, no thread pool, no CUDA context: the store task starts none where a GPU is visible), so each standby
starts from a process with no thread of ddpack's, as a DataLoader worker does. A request that comes while the forker
imports is served once it is done; once the forker is gone, the store task starts the standby cold, as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from train.distributed import first_line, run_program

Log = Callable[[str], None]


def started(generation: object, pid: int, cold: str | None = None) -> str:
    """The store task's line for a new standby: forked warm, or started cold and why."""
    how = f" cold (pid {pid}): {cold}" if cold else f" (pid {pid})"
    return f"store task: a standby took a place in generation {generation}; started a new one{how}"


def spawn_standby(environ: Mapping[str, str], log: Log) -> subprocess.Popen[bytes] | None:
    """A new standby started cold, as the store task itself was (`sys.orig_argv`: the trainer's command and flags;
    `environ`: the launcher's environment, before `launcher_role`) with --standby: a standby started by hand, the next by
    index past the launcher's (`Channel.new_standby`). Its lines and end record go where the store task's go."""
    try:
        return subprocess.Popen([*sys.orig_argv, "--standby"], env=dict(environ))
    except OSError as exc:
        log(f"store task: cannot start a new standby ({first_line(exc)}); the next death beyond the standbys left falls back")
        return None


def children_wait_s() -> float:
    """How long the forker's end waits for the standbys it started (each leaves on the run's `closed` key): as long as
    the store task waits for members that beat no more (imported here: train.recovery imports this module)."""
    from train.recovery import STORE_IDLE_S

    return STORE_IDLE_S


def warm_imports() -> None:
    """What a standby's warm-up costs beyond the trainer's own imports: torch._dynamo, which DDP's first construction
    imports (`train.recovery.warm_up`: 2.1 s of its 2.3 s here). Imports only: they start no thread."""
    import torch._dynamo  # noqa: F401  (what is imported is the point)


class StandbyForker:
    """The store task's source of new standbys: a child process forked at once (call it before the store's server
    starts a thread) that warms up (`warm_imports`) and then forks a standby for each `spawn`; each says
    so in the job's log with its pid. `close()` ends it once its standbys have left."""

    def __init__(self, environ: Mapping[str, str], argv: Sequence[str], main: Callable[[Sequence[str]], int], log: Log) -> None:
        """`environ`: the launcher's environment, each standby's; `argv`: the trainer's flags (the store task's own), to
        which each standby adds --standby; `main`: the trainer's `main`, which a forked standby runs; `log`: the store
        task's lines."""
        self.log = log
        self.environ = dict(environ)
        self._cold: list[subprocess.Popen[bytes]] = []
        sys.stdout.flush()
        sys.stderr.flush()
        read, self._requests = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the forker
            try:
                os.close(self._requests)
                _Forker(self.environ, [*argv, "--standby"], main, log).serve(read)
            finally:
                sys.stdout.flush()
                os._exit(0)
        os.close(read)

    def spawn(self, generation: int) -> None:
        """A new standby for one that generation `generation`'s decision gave a place; cold where the forker is gone."""
        try:
            os.write(self._requests, f"{generation}\n".encode())
            return
        except OSError:  # BrokenPipeError: the forker has ended (Python ignores SIGPIPE)
            pass
        if (child := spawn_standby(self.environ, self.log)) is not None:
            self._cold.append(child)
            self.log(started(generation, child.pid, "the forker has ended"))

    def end_unused(self) -> None:
        """The store never served, so no standby will be asked for: the forker is ended now, while it may still import,
        so that it does not say it is warm after the store task said it cannot serve (`close` then returns at once)."""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2  # one held in an import from a stalled file system dies when that returns: `close` reaps it
        while not _ended(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """No more standbys: the forker waits for those it started (each leaves on the run's `closed` key), then ends."""
        with contextlib.suppress(OSError):
            os.close(self._requests)
        deadline = time.monotonic() + children_wait_s() + 5
        while not _ended(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self._cold:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, deadline - time.monotonic()))


def _ended(pid: int) -> bool:
    """Whether child `pid` has ended (reaped now, or already)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def _running(children: set[int]) -> set[int]:
    """Those of `children` still running; the ended are reaped."""
    return {pid for pid in children if not _ended(pid)}


class _Forker:
    """The forked process: warms up, then forks a standby for each request."""

    def __init__(self, environ: dict[str, str], argv: list[str], main: Callable[[Sequence[str]], int], log: Log) -> None:
        self.environ, self.argv, self.main, self.log = environ, argv, main, log
        self.children: set[int] = set()

    def serve(self, requests: int) -> None:
        """Warm up, then requests until the store task closes the pipe (or is gone), then its standbys' ends."""
        for stop in (signal.SIGTERM, signal.SIGUSR1):  # as the store task: Slurm's stop signals are the ranks' and standbys'
            signal.signal(stop, signal.SIG_IGN)
        began = time.monotonic()
        try:
            warm_imports()
        except Exception as exc:  # what failed to import, a forked standby imports (and reports) itself
            self.log(f"store task: the standbys' warm-up failed ({type(exc).__name__}: {first_line(exc)}); new standbys fork without it")
        else:
            self.log(f"store task: new standbys fork warm from pid {os.getpid()} (their imports done in {time.monotonic() - began:.1f}s)")
        pending = b""
        while True:
            readable, _, _ = select.select([requests], [], [], 1.0)
            self.children = _running(self.children)
            if not readable:
                continue
            data = os.read(requests, 256)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for generation in lines:
                self._spawn(requests, generation.decode())
        deadline = time.monotonic() + children_wait_s()
        while self.children and time.monotonic() < deadline:
            time.sleep(0.1)
            self.children = _running(self.children)

    def _spawn(self, requests: int, generation: str) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            self.log(f"store task: cannot start a new standby ({first_line(exc)}); the next death beyond the standbys left falls back")
            return
        if pid == 0:
            try:
                os.close(requests)
                for stop in (signal.SIGTERM, signal.SIGUSR1):  # its watcher takes them
                    signal.signal(stop, signal.SIG_DFL)
                os.environ.clear()
                os.environ.update(self.environ)
                run_program(lambda: self.main(self.argv))  # ends the process
            finally:
                os._exit(1)
        self.children.add(pid)
        self.log(started(generation, pid))
