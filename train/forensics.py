"""What a hang leaves behind, rank by rank: every thread's Python stack, the DataLoader workers' (which dump
themselves on SIGUSR2 through faulthandler), and on NCCL torch's flight recorder, in the run folder's
`forensics/` (train.run_folder names the files). train.watchdog decides that the job hangs; this module
collects the evidence, and train.data registers the workers' dump.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import secrets
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from entrypoint.atomic_file import write_atomically
from train.run_folder import rank_stacks

WORKER_DUMP_SIGNAL = signal.SIGUSR2
STACKS_PREFIX = "ddpack-stacks-"


def write_rank_evidence(folder: Path, rank: int, header: str) -> list[int]:
    """This rank's stacks file in `folder` (the header, the NCCL trace's name, this process's threads, its
    DataLoader workers'); returns the workers' pids, which the rank kills on its way out (kill_workers)."""
    nccl = _dump_nccl_trace(folder / f"rank-{rank}.nccl-trace.pickle")
    workers, worker_pids = _worker_stacks()
    recorder = f"NCCL flight recorder: {nccl}\n" if nccl else ""
    write_atomically(folder / rank_stacks(rank), header + recorder + "\n" + thread_stacks() + ("\n" + workers if workers else ""))
    return worker_pids


# ---------------------------------------------------------------- DataLoader workers' stacks
#
# /tmp is shared by every user of a node, so the workers' folder is private by construction, as mkdtemp makes
# one: the rank draws a random name (no other user can know it: a process's environment is readable by its own
# user only) and names it to its workers in STACKS_ENV, which forked and spawned workers alike inherit; the first
# worker creates it (mkdir 0700), and every worker checks that it is a real folder of its own user that nobody
# else can write before it opens a file there, with O_EXCL|O_NOFOLLOW. Made by the first worker rather than by
# the rank, it exists only for ranks that have workers (a rank killed outright leaves it behind in /tmp, and a
# ddpack_run rank's framework never passes ddpack's worker_init_fn). A pid read from a file name is signalled
# only when it is this rank's own child (a child's pid is not reused before its parent reaps it), and no cleanup
# error ever ends a run: at most one warning line.

STACKS_ENV = "DDPACK_WORKER_STACKS_DIR"
STACKS_PREFIX = "ddpack-stacks-"
WORKER_FILE_RE = re.compile(r"^worker-(\d+)-pid(\d+)\.txt$")
MAX_WORKER_STACKS_BYTES = 1 << 20  # a worker's dump is a few KB; a runaway one does not fill the evidence

_own: tuple[int, Path] | None = None  # (the pid that named it, this rank's folder): a forked child never owns it
_own_lock = threading.Lock()
_warned = False


def prepare_worker_stacks() -> Path | None:
    """Name this rank's private folder for its DataLoader workers' stacks to them (STACKS_ENV): a random name
    in the temporary folder, which the first worker creates. The watchdog calls it when it starts, before the
    trainer's DataLoader starts its workers; None (and one warning line) when there is no temporary folder: a
    hang's evidence then lacks the workers' stacks."""
    global _own
    with _own_lock:
        folder = _own_stacks_dir()
        if folder is None:
            try:
                folder = Path(tempfile.gettempdir()) / f"{STACKS_PREFIX}{secrets.token_hex(8)}"
            except OSError as exc:
                _warn_once(
                    f"no temporary folder for the DataLoader workers' stacks ({exc.strerror or exc}); a hang's evidence will lack them"
                )
                return None
            _own = (os.getpid(), folder)
    os.environ[STACKS_ENV] = str(folder)
    return folder


def _own_stacks_dir() -> Path | None:
    """The folder this very process named (not a parent's, whose module state a forked child inherits)."""
    return _own[1] if _own is not None and _own[0] == os.getpid() else None


def _is_private_dir(path: str) -> bool:
    """A real folder (not a link) of ours that no other user can write or read: safe to create files in."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def register_worker_stack_dump(worker_id: int) -> None:
    """DataLoader worker_init_fn: on SIGUSR2 this worker writes every thread's Python stack to a file its
    rank reads (faulthandler: works while the worker is blocked in user code or in C). The file is made new
    (O_EXCL, never through a link) in the folder the rank named in STACKS_ENV (the first worker makes it, 0700),
    only when that folder is ours and private; without one (no watchdog, or a name whose folder is not ours)
    the worker dumps nothing."""
    folder = os.environ.get(STACKS_ENV)
    if not folder:
        return
    with contextlib.suppress(OSError):  # made by another worker already, or not makeable: the check below decides
        os.mkdir(folder, 0o700)
    if not _is_private_dir(folder):
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(folder, f"worker-{worker_id}-pid{os.getpid()}.txt"), flags, 0o600)
    except OSError:
        return  # the folder went away: a hang's forensics then lack this worker's stack, training goes on
    handle = os.fdopen(fd, "w")  # open for the worker's life: faulthandler keeps a reference to it
    faulthandler.register(WORKER_DUMP_SIGNAL, file=handle, all_threads=True)


def _is_own_child(pid: int) -> bool:
    """`pid` is a child of this process now (/proc/PID/stat's ppid): a name in a file is not enough to signal
    a process, since a file left by a worker long gone may name a pid the system reused."""
    try:
        return pid > 0 and int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    except (OSError, ValueError, IndexError):
        return False


def _read_private(path: Path) -> str:
    """A worker's stacks file: read without following a link, at most MAX_WORKER_STACKS_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return "(not a regular file)"
        return handle.read(MAX_WORKER_STACKS_BYTES).decode(errors="replace").strip()


def _worker_stacks(wait_s: float = 1.0) -> tuple[str, list[int]]:
    """Ask this rank's DataLoader workers for their stacks and collect them (removing their folder); and
    the workers' pids (only this rank's own children: the ones it may signal and kill)."""
    folder = _own_stacks_dir()
    if folder is None or not _is_private_dir(str(folder)):  # no workers made it (or, unthinkably, not ours)
        return "", []
    try:
        listing = sorted(os.listdir(folder))
    except OSError:
        listing = []
    named = {name: int(match[2]) for name in listing if (match := WORKER_FILE_RE.match(name))}  # file -> worker pid
    pids = [pid for pid in named.values() if _is_own_child(pid)]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, WORKER_DUMP_SIGNAL)
    if pids:
        time.sleep(wait_s)
    parts = []
    for name in named:
        text = _read_private(folder / name)
        parts.append(f"--- DataLoader {name.removesuffix('.txt')} ---\n{text or '(no answer: the worker is gone or stopped)'}")
    remove_stacks_dir()
    return "\n\n".join(parts), pids


def kill_workers(pids: list[int]) -> None:
    """A hung rank's DataLoader workers go with it. A worker blocked in a dataset never gets back to
    torch's check that its parent is alive, so it would outlive the rank, forever, wherever no cgroup or
    container ends the job's processes (a bare `python -m train`, torchrun)."""
    for pid in pids:
        if _is_own_child(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def remove_stacks_dir() -> None:
    """Remove this rank's folder of workers' stacks, and only that one (never a folder of another user, even at
    its name). Never raises: a cleanup that fails costs at most one warning line, not the run's end or its 124."""
    global _own
    with _own_lock:
        folder = _own_stacks_dir()
        if folder is None:
            return
        _own = None
    if os.environ.get(STACKS_ENV) == str(folder):
        os.environ.pop(STACKS_ENV)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise PermissionError(f"owned by uid {os.fstat(fd).st_uid}, left as it is")
            for name in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError as exc:
        _warn_once(f"could not remove {folder} ({exc.strerror or exc}); training is unaffected")


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"ddpack: warning: {message}", file=sys.stderr, flush=True)


def thread_stacks() -> str:
    """Every Python thread of this process, named, innermost frame last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog itself
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _dump_nccl_trace(path: Path) -> str | None:
    """torch's NCCL flight recorder (on with its buffer size, which init sets for nccl: train.torch_compat)."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]

        data = _dump_nccl_trace()
    except Exception:
        return None
    write_atomically(path, data)
    return path.name
