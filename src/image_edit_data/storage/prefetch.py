"""Plan-driven shard prefetch: the epoch plan says which shards the next batches need, so fetch those.

The sampler calls the prefetcher each time it hands out a batch (in the training process, where
the plan lives). The prefetcher pins the shards of every rank's batches from `behind` steps before
that one (handed out, maybe not yet loaded by a worker) to `ahead` steps after it, then downloads
the missing ones in plan order on background threads. Pinned shards are never evicted, by this
process or another on the node; a shard that does not fit yet is read by ranged requests instead.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from .shard_cache import ShardCache

log = logging.getLogger(__name__)


class PlannedSampler(Protocol):
    """What the prefetcher needs of the sampler."""

    segment_start: int

    def plan(self) -> object: ...


class ShardPrefetcher:
    """Keeps the shards of the coming batches in the local shard cache."""

    def __init__(self, cache: ShardCache, member_shard: np.ndarray, ahead: int = 8, behind: int = 8, threads: int = 2):
        self.cache = cache
        self.member_shard = member_shard
        self.ahead = ahead
        self.behind = behind
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future[bool]] = {}
        self.errors: list[BaseException] = []

    def __call__(self, sampler: PlannedSampler, step: int) -> None:
        """Batch `step` of the current epoch is being handed out: pin and fetch the window around it."""
        plan = sampler.plan()
        local = step - sampler.segment_start
        first, last = max(0, local - self.behind), min(len(plan), local + self.ahead + 1)  # type: ignore[arg-type]
        samples = plan.step_samples(slice(first, last))  # type: ignore[attr-defined]
        order = self.member_shard[samples]  # [samples in window] shard numbers, in plan order
        _, first_seen = np.unique(order, return_index=True)
        needed = [int(n) for n in order[np.sort(first_seen)]]
        self.cache.pin(set(needed))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard-prefetch")
        for number, future in list(self._pending.items()):
            if future.done():
                del self._pending[number]
                error = future.exception()
                if error is not None:
                    self.errors.append(error)
                    log.warning("prefetching a shard failed (readers use ranged requests instead): %s", error)
        for number in needed:
            if number not in self._pending and not self.cache.local_path(number).exists():
                self._pending[number] = self._pool.submit(self.cache.fetch, number)

    def wait(self) -> None:
        """Let downloads in flight finish (before workers fork, and at the end of an epoch)."""
        for future in list(self._pending.values()):
            future.exception()
        self._pending.clear()

    def close(self) -> None:
        """Finish downloads, stop the threads and release the pins."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.cache.close()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_pool"], state["_pending"] = None, {}  # threads and futures stay in their process
        return state
