"""Reading ahead of the encoders and writing behind them, so a build runs at the speed of its encoders.

The encoders stay on the calling thread and see the same windows in the same order as a build that
overlaps nothing, so the batches, and with them the bytes of the cache, do not depend on the overlap.
A thread pool reads and resizes the samples of the next windows while the current one encodes (PIL's
decoders and resampling and numpy's and torch's copies release the GIL, so threads do not queue behind
each other the way pure Python would), and writes the payloads of the windows already encoded. One more
thread appends each window's journal lines once all its payloads are on disk, in window order, so the
journal reads line for line as a serial build's.

The pool's threads run at a lower CPU priority than the encoders' thread (`lower_priority`): on a
machine whose cores the build's own work keeps busy, the encoders' thread then gets a core the moment
an encoder call returns, rather than after a reader's time slice. The threads making the pixels the
encoders take next run between the two (`PIXEL_NICENESS`): they get a core before the readers of later
windows do. The helper steps that hold the GIL for a millisecond or more wait for a moment the encoders'
thread can spare it (`gil_gate.py`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from .gil_gate import GilGate

T = TypeVar("T")
# How much lower the build's helper threads run than the encoders' thread (nice steps; Linux gives each thread its own).
HELPER_NICENESS = 10
# ... and the threads making the next pixel batches: with the readers' priority, the first window's resizing (on
# those threads) queued behind the reading of the next windows, and the encoder waited 0.6 s for it at batch 8.
PIXEL_NICENESS = 5


def lower_priority(steps: int = HELPER_NICENESS) -> None:
    """Run this thread `steps` nice steps below the process (a pool initializer). Only on Linux, where a
    thread's id names it to `setpriority`; elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + steps)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


class ReadAhead(Generic[T]):
    """The results of `read(position)` for each window in turn, with the next `depth` windows read in the pool."""

    def __init__(self, pool: Executor, windows: Sequence[Sequence[int]], read: Callable[[int], T], depth: int) -> None:
        self.pool = pool
        self.windows = windows
        self.read = read
        self.depth = depth
        self._submitted: dict[int, list[Future[T]]] = {}
        self._next = 0  # the first window not submitted yet

    def _submit_through(self, last: int) -> None:
        while self._next <= min(last, len(self.windows) - 1):
            self._submitted[self._next] = [self.pool.submit(self.read, p) for p in self.windows[self._next]]
            self._next += 1

    def futures(self, k: int) -> list[Future[T]]:
        """Window `k`'s reads in position order (started now if they were not); windows up to `k + depth` start."""
        self._submit_through(k + self.depth)
        return self._submitted.pop(k)

    def take(self, k: int) -> list[T]:
        """Window `k`'s results in position order, once read; windows up to `k + depth` are read meanwhile."""
        return [future.result() for future in self.futures(k)]

    def cancel(self) -> None:
        """Drop the reads not started yet (those running finish on their own)."""
        for futures in self._submitted.values():
            for future in futures:
                future.cancel()
        self._submitted.clear()


class WriteBehind:
    """Runs each window's writes in the pool and then its `finish` on one thread, in window order.

    At most `backlog` windows are left pending when `put` returns, so encoded tensors do not pile up
    when the disk is slower than the encoders; `backlog=0` waits for each window, as a serial build does.
    Once a window's writes or `finish` fail, no later window is finished: the journal stops where a
    serial build's would.
    """

    def __init__(self, pool: Executor, backlog: int) -> None:
        self.pool = pool
        self.backlog = backlog
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="journal")
        self._pending: deque[Future[Any]] = deque()
        self._failed = False  # only the finisher thread reads and sets it
        self.finished: list[Any] = []  # what each window's `finish` returned, in window order

    def put(self, writes: Sequence[Callable[[], T]], finish: Callable[[list[T]], Any]) -> None:
        """Start `writes`, then `finish(their results)` after the previous windows' `finish`."""
        futures = [self.pool.submit(write) for write in writes]
        self._pending.append(self._finisher.submit(self._finish, futures, finish))
        self._collect(self.backlog)

    def _finish(self, futures: list[Future[T]], finish: Callable[[list[T]], Any]) -> Any:
        if self._failed:
            raise RuntimeError("not finished: an earlier window failed")
        try:
            return finish([f.result() for f in futures])
        except BaseException:
            self._failed = True
            raise

    def _collect(self, backlog: int) -> None:
        while len(self._pending) > backlog:
            self.finished.append(self._pending.popleft().result())

    def drain(self) -> None:
        """Wait for every window put so far; raises the first failure among them."""
        try:
            self._collect(0)
        finally:
            self._finisher.shutdown(wait=True)

    def abandon(self) -> None:
        """Let the windows put so far finish (their payloads and journal lines stay valid), ignoring failures."""
        for future in self._pending:
            future.exception()
        self._pending.clear()
        self._finisher.shutdown(wait=True)


class Stopwatch:
    """Seconds spent inside encoder calls: `with stopwatch.timing(kind):` blocks (one thread at a time). A `gate`
    is told when each starts and ends."""

    def __init__(self, gate: GilGate | None = None) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.gate = gate
        self._started = 0.0
        self._kind: Hashable = None

    def timing(self, kind: Hashable) -> Stopwatch:
        """This stopwatch, for a call of `kind` (the encoder and its batch length: calls of one kind last alike)."""
        self._kind = kind
        return self

    def __enter__(self) -> Stopwatch:
        self._started = time.perf_counter()
        if self.gate is not None:
            self.gate.call_started(self._started, self._kind)
        return self

    def __exit__(self, *exc: object) -> None:
        ended = time.perf_counter()
        if self.gate is not None:
            self.gate.call_ended(ended, self._kind)
        self.seconds += ended - self._started
        self.calls += 1
