"""End a worker pool the training process has waited on for longer than `worker_timeout`.

Torch's loader waits for a batch with no timeout of its own set, checking every few seconds that
each worker is alive (so a worker that died, even one that is not a child of this process, ends the
wait within seconds). The deadline is this process's clock: while a loader waits, one thread per
process checks how long it has; past `worker_timeout` it records which workers are late (the
watch's description), then ends the pool's processes. Torch sees them gone and raises, and the
loader, finding the verdict, raises `LoaderWorkerTimeoutError` with it: a timeout is recognised by
this record, never by the text of an error, which a worker's own error could share.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

# How long a killed worker may take to be gone (a process in uninterruptible I/O dies only when it returns).
REAP_SECONDS = 5.0
LONGEST_CHECK_INTERVAL = 1.0


class WaitDeadline:
    """Ends a pool (`processes()`) once its loader has waited `timeout` seconds on it; `verdict` says who is late.

    Holds nothing of the loader, so a loader dropped without `close()` is still collected, and its
    pool with it.
    """

    def __init__(
        self, processes: Callable[[], Sequence[BaseProcess]], timeout: float, describe: Callable[[], str]
    ) -> None:
        self.processes = processes
        self.timeout = timeout
        self.describe = describe
        self.verdict: str | None = None
        # Held while the deadline ends the pool: the loader's `end()` then waits until every killed worker
        # is reaped, so no worker of the pool dies unnoticed after the loader has moved on.
        self._lock = threading.Lock()
        self._waiting_since: float | None = None
        self._pool_seen = False  # the pool's processes exist (a fork server's start is not the workers')
        _watched.add(self)
        _ensure_watching()

    def begin(self) -> None:
        """The loader starts waiting on the pool."""
        with self._lock:
            self._waiting_since = time.monotonic()

    def end(self) -> str | None:
        """The loader stopped waiting; the verdict if the deadline ended the pool meanwhile."""
        with self._lock:
            self._waiting_since = None
            return self.verdict

    def stop(self) -> None:
        """Stop watching (the pool is being shut down)."""
        _watched.discard(self)

    def check(self) -> None:
        """End the pool if its loader has waited past the deadline (called by the watching thread)."""
        with self._lock:
            since = self._waiting_since
            if self.verdict is not None or since is None:
                return
            if not self._pool_seen and self.processes():
                # The workers' clock starts when they exist: the first pool of a process waits for the fork server
                # to start and import the read path first.
                self._pool_seen = True
                self._waiting_since = time.monotonic()
                return
            if time.monotonic() - since < self.timeout:
                return
            self.verdict = self.describe()
            end_processes(self.processes())
        self.stop()


def end_processes(processes: Sequence[BaseProcess]) -> None:
    """Kill each process and wait until it is gone (reaped, when it is a child of this process)."""
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(REAP_SECONDS)


_watched: weakref.WeakSet[WaitDeadline] = weakref.WeakSet()
_watching_pid: int | None = None  # the process whose thread watches (a forked child has none)
_start_lock = threading.Lock()


def _ensure_watching() -> None:
    """Start this process's one watching thread, unless it runs: one thread, however many loaders come and go."""
    global _watching_pid
    with _start_lock:
        if _watching_pid == os.getpid():
            return
        _watching_pid = os.getpid()
        threading.Thread(target=_watch, name="loader-deadlines", daemon=True).start()


def _watch() -> None:
    # Holds the deadlines only while it checks them: one a loader has stopped is gone at once, and with it
    # everything it refers to (the watch's shared-memory table).
    while True:
        time.sleep(min([LONGEST_CHECK_INTERVAL, *(deadline.timeout / 10 for deadline in list(_watched))]))
        _check_all()


def _check_all() -> None:
    for deadline in list(_watched):
        deadline.check()
