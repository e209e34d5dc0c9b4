"""What a hang leaves behind, rank by rank: every thread's Python stack, the DataLoader workers' (which dump
themselves on SIGUSR2 through faulthandler), and on NCCL torch's flight recorder, in the run folder's
`forensics/` (train.run_folder names the files). train.watchdog decides that the job hangs; this module
collects the evidence, and train.data registers the workers' dump.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from train.run_folder import rank_stacks

WORKER_DUMP_SIGNAL = signal.SIGUSR2
STACKS_PREFIX = "ddpack-stacks-"


def write_rank_evidence(folder: Path, rank: int, header: str) -> list[int]:
    """This rank's stacks file in `folder` (the header, the NCCL trace's name, this process's threads, its
    DataLoader workers'); returns the workers' pids, which the rank kills on its way out (kill_workers)."""
    nccl = _dump_nccl_trace(folder / f"rank-{rank}.nccl-trace.pickle")
    workers, worker_pids = _worker_stacks()
    recorder = f"NCCL flight recorder: {nccl}\n" if nccl else ""
    write_atomic(folder / rank_stacks(rank), header + recorder + "\n" + thread_stacks() + ("\n" + workers if workers else ""))
    return worker_pids


# ---------------------------------------------------------------- DataLoader workers' stacks


def stacks_dir(rank_pid: int | None = None) -> Path:
    return Path(tempfile.gettempdir()) / f"{STACKS_PREFIX}{rank_pid or os.getpid()}"


def register_worker_stack_dump(worker_id: int) -> None:
    """DataLoader worker_init_fn: on SIGUSR2 this worker writes every thread's Python stack to a file its
    rank reads (faulthandler: works while the worker is blocked in user code or in C)."""
    folder = stacks_dir(os.getppid())
    try:
        folder.mkdir(exist_ok=True)
        handle = open(folder / f"worker-{worker_id}-pid{os.getpid()}.txt", "w")  # noqa: SIM115 - open for the worker's life
    except OSError:
        return  # no writable temp folder: a hang's forensics then lack this worker's stack, training goes on
    faulthandler.register(WORKER_DUMP_SIGNAL, file=handle, all_threads=True)


def _worker_stacks(wait_s: float = 1.0) -> tuple[str, list[int]]:
    """Ask this rank's DataLoader workers for their stacks and collect them (removing their files); and
    the workers' pids."""
    folder = stacks_dir()
    files = sorted(folder.glob("worker-*.txt")) if folder.is_dir() else []
    pids = [int(path.stem.rsplit("pid", 1)[1]) for path in files]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, WORKER_DUMP_SIGNAL)
    if files:
        time.sleep(wait_s)
    parts = []
    for path in files:
        text = path.read_text(errors="replace").strip()
        parts.append(f"--- DataLoader {path.stem} ---\n{text or '(no answer: the worker is gone or stopped)'}")
    remove_stacks_dir()
    return "\n\n".join(parts), pids


def kill_workers(pids: list[int]) -> None:
    """A hung rank's DataLoader workers go with it. A worker blocked in a dataset never gets back to
    torch's check that its parent is alive, so it would outlive the rank, forever, wherever no cgroup or
    container ends the job's processes (a bare `python -m train`, torchrun)."""
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Still this rank's child: a file left by a worker long gone may name a pid the system reused.
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                os.kill(pid, signal.SIGKILL)


def remove_stacks_dir() -> None:
    folder = stacks_dir()
    if folder.is_dir():
        for path in folder.iterdir():
            path.unlink(missing_ok=True)
        folder.rmdir()


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
    """torch's NCCL flight recorder (on with TORCH_NCCL_TRACE_BUFFER_SIZE, which init sets for nccl)."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]

        data = _dump_nccl_trace()
    except Exception:
        return None
    path.write_bytes(data)
    return path.name


def write_atomic(path: Path, text: str, exclusive: bool = False) -> bool:
    """Write through a temp file; `exclusive`: only if `path` does not exist yet (False when it did)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    try:
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True
