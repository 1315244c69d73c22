"""Plan-driven shard prefetch: the epoch plan says which shards the next batches need, so fetch those.

The sampler calls the prefetcher each time it hands out a batch (in the training process, where
the plan lives). The prefetcher pins the shards of every rank's batches from `behind` steps before
that one (handed out, maybe not yet loaded by a worker) to `ahead` steps after it, plus as many
further shards in plan order as the budget holds, then downloads the missing ones of the first shards
the budget holds, in plan order, on background threads. Pinned shards are never evicted, by this
process or another on the node; a shard that does not fit yet is read by ranged requests instead.

Working that out scans the plan and stats the cache, which costs more than reading a warm batch,
so it is done every `stride` steps, over a window `stride` steps longer, and whenever a download
finishes: between two refreshes, every batch's window lies inside the one pinned at the last.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from .shard_cache import DownloadStopped, ShardCache

log = logging.getLogger(__name__)


class PlannedSampler(Protocol):
    """What the prefetcher needs of the sampler."""

    segment_start: int

    def __len__(self) -> int: ...

    def plan(self) -> object: ...


class ShardPrefetcher:
    """Keeps the shards of the coming batches in the local shard cache."""

    def __init__(self, cache: ShardCache, member_shard: np.ndarray, ahead: int = 8, behind: int = 8, threads: int = 4):
        self.cache = cache
        self.member_shard = member_shard
        self.ahead = ahead
        self.behind = behind
        self.threads = threads
        self.stride = max(1, ahead // 2)  # steps between two refreshes of the pins
        self._covered: tuple[Any, int, int] | None = None  # (plan, first step, end step) the pins serve as they are
        self.slots = cache.budget // max((s.nbytes for s in cache.shards), default=1)  # shards the budget holds
        self._pool: ThreadPoolExecutor | None = None
        self._stop = threading.Event()  # set when the pool closes: its downloads in flight stop at their next piece
        self._pending: dict[int, Future[bool]] = {}
        self.errors: list[BaseException] = []

    def shards_of(self, plan: Any, first: int, last: int) -> list[int]:
        """Distinct shards of every rank's batches in steps [first, last), in order of first use."""
        order = self.member_shard[plan.step_samples(slice(first, last))]  # [samples] shard numbers, plan order
        _, first_seen = np.unique(order, return_index=True)
        return [int(n) for n in order[np.sort(first_seen)]]

    def upcoming(self, plan: Any, start: int, count: int) -> list[int]:
        """The next `count` distinct shards the plan reads from step `start` on (fewer near the epoch's end)."""
        found: list[int] = []
        chunk = max(self.ahead, 16)
        while len(found) < count and start < len(plan):
            for number in self.shards_of(plan, start, min(len(plan), start + chunk)):
                if number not in found:
                    found.append(number)
            start += chunk
        return found[:count]

    def __call__(self, sampler: PlannedSampler, step: int) -> None:
        """Batch `step` of the current epoch is being handed out: pin the window around it, fetch ahead."""
        plan: Any = sampler.plan()
        local = step - sampler.segment_start
        if step >= len(sampler):  # the epoch is handed out; downloads in flight go on (workers never fork anew)
            return
        if self.covered(plan, local):
            return
        first, last = max(0, local - self.behind), min(len(plan), local + self.ahead + self.stride)
        needed = self.shards_of(plan, first, last)
        # Beyond the window, look as many shards ahead as the budget holds besides it, and pin those
        # too: a shard fetched ahead is not evicted before the plan reaches it.
        room = max(0, self.slots - len(needed))
        needed += [n for n in self.upcoming(plan, last, room + len(needed)) if n not in needed][:room]
        self.cache.pin(set(needed))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard-prefetch")
            self._stop = threading.Event()
        for number, future in list(self._pending.items()):
            if future.done():
                del self._pending[number]
                error = future.exception()
                if error is not None and not isinstance(error, DownloadStopped):
                    self.errors.append(error)
                    log.warning("prefetching a shard failed (readers use ranged requests instead): %s", error)
        # Only the first shards the budget holds: downloads run side by side, and one further down the plan
        # must not take the room of a shard the plan reads first.
        for number in needed[: self.slots]:
            if number not in self._pending and not self.cache.local_path(number).exists():
                self._pending[number] = self._pool.submit(self.cache.fetch, number, self._stop)
        self._covered = (plan, local, local + self.stride)

    def covered(self, plan: Any, local: int) -> bool:
        """Whether the pins and downloads of the last refresh still serve step `local` of `plan`.

        They do for the `stride` steps after it, on the same plan (an epoch's plan is one object),
        while no download has finished since (its shard may need fetching again, or it failed).
        """
        if self._covered is None:
            return False
        plan_then, start, end = self._covered
        return plan_then is plan and start <= local < end and not any(f.done() for f in self._pending.values())

    def wait(self) -> None:
        """Let downloads in flight finish (each is bounded by the request deadlines)."""
        for future in list(self._pending.values()):
            if not future.cancelled():
                future.exception()
        self._pending.clear()

    def close(self) -> None:
        """Release the pins and return at once: queued downloads are dropped, and those in flight end on their own.

        A download in flight stops at its next piece (a shard of one piece ends with its request,
        within the request's deadline), then removes its hidden temporary file; its thread ends
        with it. Waiting for it here would hold up a loader's rebuild for a whole download.
        """
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self.cache.close()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_pool"], state["_pending"] = None, {}  # threads and futures stay in their process
        del state["_stop"]
        state["_covered"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()
