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
- A worker that does not answer within `worker_timeout` becomes a `LoaderWorkerTimeoutError`
  naming the rank, the worker and what it was doing (`workers/watch.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ..contract.batch import Batch
from ..sampling.resume import loader_state, note_consumed, sampler_state_of
from ..sampling.sampler import BucketBatchSampler
from .start import DEFAULT_WORKER_START, WorkerStart, start_failure_hint, worker_context
from .watch import LoaderWorkerTimeoutError, WatchedDataset, WorkerWatch


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
        worker_start: WorkerStart = DEFAULT_WORKER_START,
        **options: Any,
    ) -> None:
        self.watch = WorkerWatch(num_workers, batch_sampler.rank, worker_timeout) if num_workers > 0 else None
        workers: dict[str, Any] = {}
        if self.watch is not None:
            workers = {
                "multiprocessing_context": worker_context(worker_start),
                "persistent_workers": True,
                "timeout": worker_timeout,
                "worker_init_fn": self.watch.worker_init_fn(),
            }
        if self.watch is not None:
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
        self.worker_start = worker_start
        # Weak: the pass refers to this loader, and a strong link back would keep both (and the pool) alive
        # until the cyclic garbage collector ran.
        self._pass_in_progress: weakref.ref[Generator[Batch, None, None]] | None = None
        self._pool_started = False

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        """This pass's batches; each one moves the sampler's consumed position as it is handed over."""
        batches = self._pass()
        self._pass_in_progress = weakref.ref(batches)
        return batches

    def _pass(self) -> Generator[Batch, None, None]:
        # A generator: the pool starts (or resumes) at the first `next`, inside the timeout guard.
        sampler: BucketBatchSampler = self.batch_sampler  # type: ignore[assignment]
        batches = self._guarded(lambda: super(ResumableDataLoader, self).__iter__())
        while True:
            batch = self._guarded(lambda: next(batches, None))
            if batch is None:
                sampler.note_pass_end()
                return
            note_consumed(sampler, batch)
            yield batch

    def _guarded(self, step: Callable[[], Any]) -> Any:
        """Run one step of torch's loader; its timeout becomes an error naming the late worker."""
        if self.watch is not None and not self._pool_started:
            self.watch.reset()  # a pool is about to start
        try:
            result = step()
            self._pool_started = self.watch is not None
            return result
        except RuntimeError as error:
            if self.watch is None:
                raise
            if "timed out" not in str(error):
                if not self._pool_started and "exited unexpectedly" in str(error):
                    hint = start_failure_hint(self.worker_start)
                    raise RuntimeError(f"{error} while the pool started{hint}") from error
                raise
            message = self.watch.describe()
            self._pass_in_progress = None  # the pass raising this ends with it (it cannot close itself)
            self.close()
            raise LoaderWorkerTimeoutError(message) from error

    def state_dict(self) -> dict[str, Any]:
        """The sampler's consumed position (never counts batches workers only prefetched)."""
        return loader_state(self.batch_sampler)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the sampler from a state this loader saved (or torchdata saved for it, with any `num_workers`)."""
        self.close()
        if state_dict:
            self.batch_sampler.load_state_dict(sampler_state_of(state_dict))  # type: ignore[union-attr]

    def close(self) -> None:
        """Shut this loader's worker pool down now; the next pass starts a new one."""
        current = self._pass_in_progress() if self._pass_in_progress is not None else None
        if current is not None:
            current.close()  # releases the torchdata iterator it holds
        self._pass_in_progress = None
        self._pool_started = False
        super().load_state_dict({})  # torchdata's public way to drop the live iterator, whose finaliser stops the pool
