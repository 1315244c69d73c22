"""This process's loader workers as the operating system sees them: found in /proc, whoever their parent is.

A fork server's workers are its children, not this process's, so `multiprocessing.active_children()`
alone cannot show that one is still running after its loader let go of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from types import TracebackType

# Descendants that serve every pool of the process and are not workers (a fork server's workers, forked
# from it, carry its command line too: the server is the one whose parent does not).
SERVERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: it only waits for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parents() -> dict[int, int]:
    """Parent of every process on the machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def worker_processes(root: int | None = None) -> set[int]:
    """Running descendants of `root` (this process) other than its fork server and resource tracker."""
    root = os.getpid() if root is None else root
    parent_of = parents()
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        command = command_line(pid)
        server = any(name in command and name not in command_line(parent_of[pid]) for name in SERVERS)
        if alive(pid) and not server:
            found.add(pid)
    return found


class SeenWorkers:
    """Records, in a thread, every worker process that runs while the `with` block runs (polled every 50 ms)."""

    def __init__(self) -> None:
        self.before = worker_processes()
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.seen |= worker_processes() - self.before
            time.sleep(0.05)

    def __enter__(self) -> SeenWorkers:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        # One last look: a pass over a tiny cache can start its pool and finish between two polls.
        self.seen |= worker_processes() - self.before

    def still_running(self) -> list[int]:
        """The recorded workers that still run."""
        return sorted(pid for pid in self.seen if alive(pid))


def session_members(session: int) -> list[int]:
    """Running processes of the session `session` (a command started with `start_new_session=True` and all it
    started, however deep, unless they left the session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def end_session(session: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of the session `session` until none is left (members may start more meanwhile)."""
    deadline = time.monotonic() + timeout
    while (members := session_members(session)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
