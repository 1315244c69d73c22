"""Waking when a directory changes: Linux inotify, where the file system delivers it, else a plain timeout.

Rank 0 waits here for the other ranks' journal lines and failure markers. On a local disk any process's
write to the directory wakes it at once. A network file system written from other machines delivers no
such event, so every wait also ends after its timeout: the longest rank 0 goes without a look.
Linux's inotify is reached through libc (ctypes): the standard library has no binding for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import sys
import time
from pathlib import Path

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
# An append to a journal, a file closed after writing, an atomic rename into place (failure markers), a new file.
CHANGES = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE


class DirectoryWatch:
    """Changes to the files of one directory, as a wait that returns when there was one."""

    def __init__(self, directory: Path) -> None:
        self._fd = -1
        if not sys.platform.startswith("linux"):
            return
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                return
            if libc.inotify_add_watch(fd, os.fsencode(directory), CHANGES) < 0:
                os.close(fd)
                return
            self._fd = fd

    @property
    def notifies(self) -> bool:
        """Whether changes wake `wait` (otherwise it only times out)."""
        return self._fd >= 0

    def wait(self, timeout: float) -> None:
        """Return once the directory changed since the last call (at once if it already has), or after `timeout` s."""
        if self._fd < 0:
            time.sleep(max(timeout, 0.0))
            return
        readable, _, _ = select.select([self._fd], [], [], max(timeout, 0.0))
        while readable:  # consume the events, so the next wait blocks until a new change
            try:
                os.read(self._fd, 65536)
            except BlockingIOError:
                break

    def close(self) -> None:
        """Stop watching."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
