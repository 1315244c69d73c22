"""Readers for caches at URLs: one payload object per sample, or members of remote tar shards.

Remote bytes (one ranged request per sample) are put in an anonymous in-memory file, so the
payload code reads them through a descriptor as it reads a local file. With a node-local shard
cache, a cached shard is read in place and a missing one falls back to a ranged request (the
prefetcher downloads shards, readers never wait for it). Each member read is checked against its
checksum where the cache has them; a cache packed before checksums has nothing to compare, so
there a member of a shard the node marked damaged (`damaged.py`) is refused rather than read.
"""

from __future__ import annotations

from ..errors import fail
from ..index.index import CacheIndex
from ..index.packed import check_member_bytes
from ..payload.payload import OpenPayload, open_payload
from .damaged import DamagedShards
from .prefetch import ShardPrefetcher
from .reader import PayloadReader, memory_file, open_checked, remote_member
from .remote import RemoteStore
from .shard_cache import ShardCache

DOWNLOAD_WAIT = 30.0  # seconds a reader waits for a shard download in progress before fetching its own bytes


class RemoteFilesReader(PayloadReader):
    """One payload object per sample at a URL, each fetched whole."""

    store: RemoteStore

    def __init__(self, index: CacheIndex, store: RemoteStore) -> None:
        super().__init__(index)
        self.store = store

    def display(self, idx: int) -> str:
        return self.store.url_of(self.index.relative_path(idx))

    def open(self, idx: int) -> OpenPayload:
        relative = self.index.relative_path(idx)
        data = self.store.read_all(relative)
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

    def display(self, idx: int) -> str:
        shard = self.index.shards[self.index.member(idx)[0]].path
        return f"{self.store.url_of(shard)}[{self.index.relative_path(idx)}]"

    def open(self, idx: int) -> OpenPayload:
        display = self.display(idx)
        number, offset, length = self.index.member(idx)
        shard = self.index.shards[number]
        expected = self.index.checksum(idx)
        if self.shard_cache is not None:
            local = self.shard_cache.open_when_cached(number, timeout=DOWNLOAD_WAIT)
            if local is not None:
                descriptor, info = local
                path = str(self.shard_cache.local_path(number))
                return open_checked(path, descriptor, info, shard.nbytes, path, display, (offset, length), expected)
            self.fallbacks += 1
        if expected is None:
            self.refuse_if_damaged(number, display)
        data = self.store.read_range(shard.path, offset, length)
        if expected is not None:
            check_member_bytes(data, expected, display, "ranged read")
        descriptor, info = memory_file(data, display)
        return open_payload(f"/proc/self/fd/{descriptor}", display, (descriptor, info), (0, length))

    def shard_bytes(self, number: int) -> bytes:
        return self.store.read_all(self.index.shards[number].path)

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
