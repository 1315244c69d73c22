"""`ResumableDataLoader`: torchdata's StatefulDataLoader with one persistent worker pool and our resume state.

- One pool per loader. Workers start at the first iteration and serve every later pass, so an
  epoch change forks nothing: a fork of the training process while its threads start or exit (a
  pool's queue threads, a progress bar's, a prefetcher's) can leave the child stuck in CPython's
  after-fork handler, and a pool per epoch made that a matter of time under DDP.
- Our sampler still drives every pass: each pass starts at the sampler's consumed position.
- The state is the sampler's consumed position (`sampling/resume.py`): exact at any moment, with
  any `num_workers` on either side. So torchdata's own per-step snapshot of the loader state
  (the sampler's state built with every batch handed to a worker, the workers' state sent back
  with every batch) would serve nothing: it is turned off.
- Torch waits for the workers with no timeout of its own, so it checks every few seconds that each
  one is alive: a worker that died, even one that is not a child of this process (a fork server's),
  ends the wait within seconds. A worker that does not answer within `worker_timeout`, by this
  process's clock (`workers/deadline.py`), becomes a `LoaderWorkerTimeoutError` naming the rank, the
  worker and what it was doing (`workers/watch.py`).
- `close()` and every failure of the pool end it: its processes are gone when they return.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import traceback
import weakref
from collections.abc import Callable, Generator, Iterator, Set
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, TypeVar

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ..contract.batch import Batch
from ..sampling.resume import loader_state, note_consumed, sampler_state_of
from ..sampling.sampler import BucketBatchSampler
from .deadline import WaitDeadline, end_processes
from .killed_pool import release_lock_of_killed_workers
from .start import (
    WorkerStart,
    choose_start,
    note_server_used,
    refuse_a_rerun_of_main,
    start_failure_hint,
    worker_context,
)
from .watch import LoaderWorkerTimeoutError, WatchedDataset, WorkerWatch

log = logging.getLogger(__name__)
T = TypeVar("T")


class ResumableDataLoader(StatefulDataLoader):
    """A StatefulDataLoader over our batch sampler: persistent workers, consumed-position state, watched workers."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_sampler: BucketBatchSampler,
        collate_fn: Callable[[Any], Batch],
        num_workers: int,
        worker_timeout: float,
        worker_start: WorkerStart | None = None,
        **options: Any,
    ) -> None:
        self.watch = WorkerWatch(num_workers, batch_sampler.rank, worker_timeout) if num_workers > 0 else None
        self.worker_start: WorkerStart | None = None
        workers: dict[str, Any] = {}
        if self.watch is not None:
            self.worker_start = choose_start(worker_start, (dataset, collate_fn))
            workers = {
                "multiprocessing_context": worker_context(self.worker_start),
                "persistent_workers": True,
                "worker_init_fn": self.watch.worker_init_fn(),
            }
            dataset = WatchedDataset(dataset, self.watch)  # workers mark each batch they fetch
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            snapshot_every_n_steps=None,  # nothing reads torchdata's snapshots: `state_dict` is the sampler's
            **workers,
            **options,
        )
        batch_sampler.consumption_tracked = True
        self.worker_timeout = worker_timeout
        # Weak: the pass refers to this loader, and a strong link back would keep both (and the pool) alive
        # until the cyclic garbage collector ran.
        self._pass_in_progress: weakref.ref[Generator[Batch, None, None]] | None = None
        # Torch's iterator of the current pass. Held here and nowhere else (no local variable of a
        # running frame), so that ending the pool releases the iterator, whose finaliser stops the workers.
        self._batches: Iterator[Batch] | None = None
        self._pool: list[BaseProcess] = []  # the running pool's processes
        self._pool_running = False
        self._pool_answered = False  # the running pool has delivered a batch
        self._deadline: WaitDeadline | None = None
        self._starting: PoolProcesses | None = None  # the running pool's processes, as the deadline sees them

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        """This pass's batches; each one moves the sampler's consumed position as it is handed over."""
        batches = self._pass()
        self._pass_in_progress = weakref.ref(batches)
        return batches

    def _pass(self) -> Generator[Batch, None, None]:
        # A generator: the pool starts (or resumes) at the first `next`, inside the guard.
        sampler: BucketBatchSampler = self.batch_sampler  # type: ignore[assignment]
        self._guarded(self._start_pass)
        while True:
            batch = self._guarded(self._next_batch)
            if batch is None:
                sampler.note_pass_end()
                return
            note_consumed(sampler, batch)
            yield batch

    def _start_pass(self) -> None:
        self._batches = super().__iter__()

    def _next_batch(self) -> Batch | None:
        if self._batches is None:
            raise RuntimeError("the loader's pool was shut down during this pass; start a new pass")
        return next(self._batches, None)

    def _guarded(self, step: Callable[[], T]) -> T:
        """Run one step of torch's loader under the pool's deadline; turn a failure of the pool into a clear error."""
        if self.watch is None:
            return step()
        starting = not self._pool_running
        if starting:
            self._start_pool()
        if self._deadline is not None:
            self._deadline.begin()
        try:
            result = step()
        except BaseException as error:
            verdict = self._stop_clock(starting)
            if verdict is not None and isinstance(error, Exception):
                self._end_pool(error)
                raise LoaderWorkerTimeoutError(verdict) from error
            self._fail(error, starting)
        verdict = self._stop_clock(starting)
        if verdict is not None:  # the batch came just as the deadline ended the pool
            self._end_pool()
            raise LoaderWorkerTimeoutError(verdict)
        if result is not None:
            self._pool_answered = True
        return result

    def _stop_clock(self, starting: bool) -> str | None:
        """The loader stopped waiting: the deadline's verdict, if it ended the pool; note a new pool's processes."""
        while True:
            try:
                verdict = self._deadline.end() if self._deadline is not None else None
                if starting and self._starting is not None:
                    self._pool = self._starting.fix()
                return verdict
            except RuntimeError:
                # Torch's SIGCHLD handler reporting a worker the deadline has just killed (a child of this process):
                # the deadline holds its lock until every such worker is reaped, so this ends.
                continue

    def _fail(self, error: BaseException, starting: bool) -> NoReturn:
        """Re-raise a failure of torch's loader, ending the pool first when it cannot go on: one of its workers has
        ended (even one that is not a child of this process), or it failed to start."""
        if not isinstance(error, Exception):
            raise error
        release_frames(error)  # whoever keeps the error must not keep torch's iterator, and with it the pool, alive
        # `_pool` holds the processes alive when the pool was seen last; torch drops ended ones from this
        # process's list of children as it finds them, so a pool starting with fewer than it asked for lost some.
        ended = len(self._pool) < self.num_workers or any(process.exitcode is not None for process in self._pool)
        if not ended and not starting:
            raise error  # a worker's own error: the pool lives on, as torch's does
        answered = self._pool_answered
        self._end_pool(error)
        if answered or not ended:
            raise error
        raise RuntimeError(f"{error} before the pool delivered its first batch{start_failure_hint(self.worker_start)}")

    def _start_pool(self) -> None:
        """Before the step that starts a pool: a fresh watch table, and the deadline over the processes it starts."""
        assert self.watch is not None
        refuse_a_rerun_of_main()
        if self.worker_start == "forkserver":
            note_server_used()
        self.watch.renew()
        self._starting = PoolProcesses({process.pid for process in multiprocessing.active_children()})
        self._pool_running = True
        if self.worker_timeout > 0:
            self._deadline = WaitDeadline(self._starting, self.worker_timeout, self.watch.describe)

    def _end_pool(self, error: BaseException | None = None, at_once: bool = False) -> None:
        """Stop the running pool; its processes are gone when this returns, and the next pass starts a new one.

        `at_once` (closing the loader) ends a fork server's workers without waiting for a batch they are loading.
        """
        processes, self._pool, self._starting = self._pool, [], None
        if self._deadline is not None:
            self._deadline.stop()
            self._deadline = None
        if error is not None:
            release_frames(error)
        if (error is not None or at_once) and self.worker_start == "forkserver":
            # A failed pool's workers may be stuck, and a closed loader's may be loading a batch nobody will take: end
            # them now rather than have torch wait for each. A fork server's workers are not children of this process,
            # so no SIGCHLD reaches torch's handler.
            end_processes(processes)
            release_lock_of_killed_workers(getattr(self, "_iterator", None))
        batches = weakref.ref(self._batches) if self._batches is not None else None
        self._batches = None
        self._pool_running = False
        self._pool_answered = False
        super().load_state_dict({})  # torchdata's public way to drop its iterator, whose finaliser stops the pool
        if self.num_workers == 0:
            return  # no pool: nothing for the (costly) collection below to stop
        if batches is not None and batches() is not None:
            gc.collect()  # held in a reference cycle: the collector runs its finaliser, which stops the pool
        if batches is not None and batches() is not None and self.worker_start != "forkserver":
            # Torch's finaliser has not run, so its SIGCHLD handler still watches these children: ending them
            # here would raise in this process. (A fork server's workers are not children: they end below.)
            log.warning("the loader's old worker pool is still referenced; its workers end when it is collected")
            return
        end_processes([process for process in processes if process.exitcode is None])

    def state_dict(self) -> dict[str, Any]:
        """The sampler's consumed position (never counts batches workers only prefetched)."""
        return loader_state(self.batch_sampler)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the sampler from a state this loader saved (or torchdata saved for it, with any `num_workers`)."""
        self.close()
        if state_dict:
            self.batch_sampler.load_state_dict(sampler_state_of(state_dict))  # type: ignore[union-attr]

    def close(self) -> None:
        """Shut this loader's worker pool down now (its processes are gone on return), stop its prefetching and
        close the files its dataset opened in this process (with 0 workers, the cached shards it read).

        The next pass starts a new pool, and the dataset reopens what it reads.
        """
        current = self._pass_in_progress() if self._pass_in_progress is not None else None
        if current is not None:
            current.close()
        self._pass_in_progress = None
        self._end_pool(at_once=True)
        self.batch_sampler.close()  # type: ignore[union-attr]
        close_files = getattr(self.dataset, "close", None)
        if callable(close_files):
            close_files()


class PoolProcesses:
    """The processes of one pool: while it starts, the child processes started since; then those, fixed.

    Torch starts the workers inside the step that starts the pool, so until that step returns they
    are the children that appeared meanwhile (this loader's thread starts nothing else); from then
    on the list is fixed, so a deadline never ends the workers of a loader started later.
    """

    def __init__(self, existing: Set[int | None]) -> None:
        self.existing = frozenset(existing)
        self.known: list[BaseProcess] | None = None

    def __call__(self) -> list[BaseProcess]:
        return self.known if self.known is not None else children_since(self.existing)

    def fix(self) -> list[BaseProcess]:
        """The pool has started: its processes are those started so far, for good."""
        if self.known is None:
            self.known = children_since(self.existing)
        return self.known


def children_since(existing: Set[int | None]) -> list[BaseProcess]:
    """This process's running child processes other than `existing`."""
    return [process for process in multiprocessing.active_children() if process.pid not in existing]


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames in the traceback of `error` and of its causes.

    Those are the loader's and torch's frames below the step that raised it (running frames are left
    alone), and torch's hold its iterator, whose finaliser is what stops the workers: kept by the
    error (and by whoever catches it), they would keep the pool running. Torch chains its own errors
    by cause (`raise ... from`); an exception being handled when the step ran (the context) is the
    caller's, and left as it is.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__
