"""Which processes open a file while something runs: Linux fanotify's FAN_OPEN events on that file, read by a
thread of this process (root only). An open by any process counts, in any mount namespace (the mark follows
the inode), so a test sees every node's read of a squashfs on the shared folder, as a shared filesystem would
serve them. fanotify merges two events only when the same process caused both, so `pids` misses no reader
(inotify, which merges any two alike, would)."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from pathlib import Path

FAN_CLASS_NOTIF = 0x0
FAN_CLOEXEC, FAN_NONBLOCK = 0x1, 0x2
FAN_MARK_ADD = 0x1
FAN_OPEN = 0x20
AT_FDCWD = -100
_EVENT = struct.Struct("IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid


class OpenCounter:
    """`with OpenCounter(path) as opens: ...`; then `opens.pids`: the processes that opened `path` meanwhile,
    with how many opens each, and `opens.command(pid)`: what that process was (read while it ran)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pids: dict[int, int] = {}
        self.commands: dict[int, str] = {}
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        self._stop = threading.Event()

    def __enter__(self) -> OpenCounter:
        self._fd = self._libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY)
        if self._fd < 0 or self._libc.fanotify_mark(self._fd, FAN_MARK_ADD, FAN_OPEN, AT_FDCWD, os.fsencode(self.path)) < 0:
            raise OSError(ctypes.get_errno(), f"fanotify cannot watch {self.path} (root only)")
        self._thread = threading.Thread(target=self._read, name="open-counter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)

    @property
    def opens(self) -> int:
        return sum(self.pids.values())

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd], [], [], 0.2)
            if not ready:
                if self._stop.is_set():
                    return  # nothing pending after the stop: every open before it was read
                continue
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                continue
            offset = 0
            while offset + _EVENT.size <= len(data):
                length, _, _, _, mask, fd, pid = _EVENT.unpack_from(data, offset)
                if fd >= 0:
                    os.close(fd)  # fanotify hands over an open descriptor of the file with each event
                if mask & FAN_OPEN:
                    self.pids[pid] = self.pids.get(pid, 0) + 1
                    if pid not in self.commands:
                        try:
                            self.commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                        except OSError:
                            self.commands[pid] = "?"
                offset += length
