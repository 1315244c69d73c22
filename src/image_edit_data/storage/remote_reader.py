"""Readers for caches at URLs: one payload object per sample, or members of remote tar shards.

A remote file of its own (one request per sample) is put in an anonymous in-memory file, so the
payload code reads it through a descriptor as it reads a local file (a `.pt` payload needs one).
A member of a remote tar shard (one ranged request) is parsed where its bytes lie, and the batch
copies its tensors out of them, checking its checksum in that same pass. A batch's requests run
concurrently (up to `CONCURRENT_REQUESTS` at a time per process), so a batch costs about one round
trip rather than one per sample; the first request to fail for good ends the batch's wait. With
a node-local shard cache, a cached shard is read in place; a batch waits (a bounded time, once
per download) for downloads of its shards already under way, and reads a shard still missing
then by ranged requests (`CachedShardFiles`). A missing object is a content fault, as a missing
local file is. Each member read is checked against its checksum where the cache has them; a cache
packed before checksums has nothing to compare, so there a member of a shard the node marked
damaged (`damaged.py`) is refused rather than read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

from ..errors import CacheFormatError, fail, read_failed
from ..index.index import CacheIndex
from ..payload.member_check import Buffer
from ..payload.payload import OpenPayload, open_member, open_payload, payload_from_bytes
from .damaged import DamagedShards
from .prefetch import ShardPrefetcher
from .reader import (
    CachedShardFiles,
    NotCached,
    Opened,
    PayloadReader,
    close_opened,
    collect,
    memory_file,
    remote_member,
)
from .remote import RemoteStore
from .secrets import redacted_url
from .shard_cache import ShardCache

T = TypeVar("T")
CONCURRENT_REQUESTS = 16  # per process: enough to hide a round trip for a batch, few enough to be polite


class Fetcher:
    """Runs a batch's remote requests on a small thread pool of this process (made on first use, never pickled)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, object]:
        return {"_pool": None, "_pid": -1}

    def run(self, requests: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Each request's result or error, in order; one request runs inline.

        The first error other than a content fault ends the wait: requests not started yet are
        dropped, and in their places (and those of requests still running, left to end within their
        own deadlines) stands that error, which the batch raises.
        """
        if len(requests) <= 1:
            return [capture(request) for request in requests]
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(CONCURRENT_REQUESTS, thread_name_prefix="remote-read")
            self._pid = os.getpid()
        futures = [self._pool.submit(capture, request) for request in requests]
        for future in as_completed(futures):
            result = future.result()
            if isinstance(result, BaseException) and not isinstance(result, CacheFormatError):
                for other in futures:
                    other.cancel()
                return [f.result() if f.done() and not f.cancelled() else result for f in futures]
        return [future.result() for future in futures]


def capture(request: Callable[[], T]) -> T | BaseException:
    """The request's result, or the exception it raised."""
    try:
        return request()
    except Exception as error:
        return error


class RemoteFilesReader(PayloadReader):
    """One payload object per sample at a URL, each fetched whole."""

    store: RemoteStore

    def __init__(self, index: CacheIndex, store: RemoteStore) -> None:
        super().__init__(index)
        self.store = store
        self.fetcher = Fetcher()

    def display(self, idx: int) -> str:
        return redacted_url(self.store.url_of(self.index.relative_path(idx)))

    def open(self, idx: int) -> OpenPayload:
        return one(self.open_many([idx]))

    def open_many(self, indices: Sequence[int]) -> list[Opened]:
        fetched = self.fetcher.run([functools.partial(self.fetch, i) for i in indices])
        return collect([functools.partial(self.from_fetched, i, data) for i, data in zip(indices, fetched)])

    def fetch(self, idx: int) -> Buffer:
        """Payload `idx`'s bytes; a missing object is a content fault naming it, as a missing local file is."""
        try:
            return self.store.fetch(self.index.relative_path(idx))  # type: ignore[no-any-return]
        except FileNotFoundError as error:
            read_failed(self.display(idx), error)

    def from_fetched(self, idx: int, data: Buffer | BaseException) -> OpenPayload:
        """Payload `idx` from its fetched bytes (or the error fetching them raised)."""
        if isinstance(data, BaseException):
            raise data
        relative = self.index.relative_path(idx)
        opened = memory_file(data, relative)
        return open_payload(f"/proc/self/fd/{opened[0]}", self.display(idx), opened, remote_member(relative, len(data)))


class RemotePackedReader(PayloadReader):
    """Members of tar shards at a URL: ranged requests, or shards kept in the node-local shard cache."""

    store: RemoteStore

    def __init__(
        self, index: CacheIndex, store: RemoteStore, shard_cache: ShardCache | None, damaged: DamagedShards
    ) -> None:
        super().__init__(index)
        self.store = store
        self.shard_cache = shard_cache
        self.damaged = damaged
        self.fallbacks = 0  # shard-cache misses served by a ranged request, in this process
        self.fetcher = Fetcher()
        if shard_cache is not None:  # each cached shard opened once per process, not per sample
            self.cached_files = CachedShardFiles(shard_cache, store.retry.download_wait)

    def display(self, idx: int) -> str:
        shard = self.index.shards[self.index.member(idx)[0]].path
        return f"{redacted_url(self.store.url_of(shard))}[{self.index.relative_path(idx)}]"

    def open(self, idx: int) -> OpenPayload:
        return one(self.open_many([idx]))

    def open_many(self, indices: Sequence[int]) -> list[Opened]:
        cached: list[Opened | None] = []  # None: not in the shard cache, read by range
        try:
            if self.shard_cache is not None:
                self.cached_files.wait_for_downloads({self.index.member(idx)[0] for idx in indices})
            for idx in indices:
                try:
                    cached.append(self.from_shard_cache(idx))
                except CacheFormatError as error:
                    cached.append(error)
            ranged = [idx for idx, found in zip(indices, cached) if found is None]
            fetched = self.fetcher.run([functools.partial(self.ranged_bytes, idx) for idx in ranged])
            from_range = iter(
                collect([functools.partial(self.from_bytes, i, data) for i, data in zip(ranged, fetched)])
            )
            return [found if found is not None else next(from_range) for found in cached]
        except BaseException:
            close_opened(cached)
            raise

    def from_shard_cache(self, idx: int) -> OpenPayload | None:
        """Payload `idx` from the node's shard cache when its shard is there (None: read it by range)."""
        if self.shard_cache is None:
            return None
        number, offset, length = self.index.member(idx)
        try:
            path, descriptor = self.cached_files.take(number)
        except NotCached:
            self.fallbacks += 1
            return None
        try:
            release = functools.partial(self.cached_files.give_back, number)
            return open_member(
                descriptor,
                self.display(idx),
                (offset, length),
                self.index.checksum(idx),
                f"read from {path}",
                release=release,
            )
        except BaseException:
            self.cached_files.give_back(number)
            raise

    def ranged_bytes(self, idx: int) -> Buffer:
        """Member `idx`'s bytes, by one ranged request (refused for a shard known damaged with nothing to check by)."""
        number, offset, length = self.index.member(idx)
        if self.index.checksum(idx) is None:
            self.refuse_if_damaged(number, self.display(idx))
        try:
            return self.store.read_range(self.index.shards[number].path, offset, length)
        except FileNotFoundError as error:  # the shard is gone: a content fault, as a missing local shard is
            read_failed(self.display(idx), error)

    def from_bytes(self, idx: int, data: Buffer | BaseException) -> OpenPayload:
        """Payload `idx` from its fetched member bytes (or the fetch's error), parsed where they lie.

        The batch copies the tensors out of these bytes and checks the member's checksum in that same
        pass; bytes that do not match are fetched once more before the member counts as damaged, so
        a range damaged in flight is a retry, not a corrupt sample (`payload_from_bytes`).
        """
        if isinstance(data, BaseException):
            raise data
        return payload_from_bytes(
            data,
            self.display(idx),
            self.index.checksum(idx),
            source="ranged read",
            refetch=functools.partial(self.ranged_bytes, idx),
        )

    def shard_bytes(self, number: int) -> bytes:
        shard = self.index.shards[number]
        return self.store.read_all(shard.path, shard.nbytes)

    def close(self) -> None:
        if self.shard_cache is not None:
            self.cached_files.close()

    def prefetcher(self, in_flight: int) -> ShardPrefetcher | None:
        """With a shard cache: pin the batches workers may hold and fetch further ahead (the budget bounds it)."""
        if self.shard_cache is None or self.index.member_shard is None:
            return None
        return ShardPrefetcher(self.shard_cache, self.index.member_shard, 2 * in_flight + 4, in_flight)

    def refuse_if_damaged(self, number: int, display: str) -> None:
        """Refuse a member of a shard this node found damaged, in a cache with no member checksums to check it by.

        With member checksums each ranged read is checked on its own, which serves a shard's intact
        members and refuses its damaged ones whenever they are read: the outcome depends on the data only.
        """
        shard = self.index.shards[number]
        if self.damaged is None or (verdict := self.damaged.find(shard)) is None:
            return
        fail(
            display,
            verdict.field,
            f"{verdict.reason()}; the shard is marked damaged on this node ({self.damaged.path(shard)}) and "
            "the cache has no member checksums to check a member by, so none of its members is read",
        )


def one(results: list[Opened]) -> OpenPayload:
    """The only payload of `results`, or raise its contract error."""
    (result,) = results
    if isinstance(result, CacheFormatError):
        raise result
    return result
