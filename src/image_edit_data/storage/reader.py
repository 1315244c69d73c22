"""Open one sample's payload wherever it lives: a local file, a member of a local tar shard, or remote.

The local one-file-per-sample case stays in `ImageEditDataset.open_sample`; this module handles
the packed layout and caches at URLs. Remote bytes (one ranged request per sample) are put in an
anonymous in-memory file, so the payload code reads them through a descriptor as it reads a local
file; with a local shard cache, a cached shard is read in place and a missing one falls back to a
ranged request (the prefetcher downloads shards, readers never wait for it).

Every read of a member is checked against its recorded checksum (storage/packed.py) when the cache
has them: the member's bytes are hashed once, where the reader has them (the ranged read's result,
or one `pread` of the member from a local shard, whose tensors the batch then reads from the page
cache). A cache packed before checksums has nothing to compare; there a member of a shard the
node marked damaged (storage/damaged.py) is refused rather than read by range.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..contract.paths import ContainedOpener
from ..errors import fail
from ..index.index import CacheIndex
from ..payload.payload import OpenPayload, open_payload
from .damaged import DamagedShards
from .packed import check_member_bytes
from .remote import RemoteStore
from .shard_cache import ShardCache

DOWNLOAD_WAIT = 30.0  # seconds a reader waits for a shard download in progress before fetching its own bytes


def memory_file(data: bytes, name: str) -> tuple[int, os.stat_result]:
    """An anonymous file holding `data` (memfd on Linux), as a descriptor and its stat."""
    if hasattr(os, "memfd_create"):
        descriptor = os.memfd_create(name[-200:].replace("/", "_"), os.MFD_CLOEXEC)
    else:  # TODO(portability): other systems get an unlinked temporary file
        descriptor, path = tempfile.mkstemp(prefix="image-edit-data-")
        os.unlink(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
        return descriptor, os.fstat(descriptor)
    except BaseException:
        os.close(descriptor)
        raise


class PayloadReader:
    """Opens sample payloads of a packed or remote cache (picklable: workers get their own clients)."""

    def __init__(
        self,
        index: CacheIndex,
        store: RemoteStore | None = None,
        shard_cache: ShardCache | None = None,
        damaged: DamagedShards | None = None,
    ) -> None:
        self.index = index
        self.store = store
        self.shard_cache = shard_cache
        self.damaged = damaged if damaged is not None or shard_cache is None else shard_cache.damaged
        self.opener = ContainedOpener(index.root)
        self.fallbacks = 0  # shard-cache misses served by a ranged request, in this process

    def display(self, idx: int) -> str:
        """How errors name sample `idx`: the member inside its shard, or the file (URL when remote)."""
        relative = self.index.relative_path(idx)
        if self.index.packed:
            shard = self.index.shards[self.index.member(idx)[0]].path
            where = self.store.url_of(shard) if self.store else shard
            return f"{where}[{relative}]"
        return self.store.url_of(relative) if self.store else relative

    def open(self, idx: int) -> OpenPayload:
        """Payload `idx`, opened (tensors still unread) and owning its descriptor."""
        display = self.display(idx)
        if not self.index.packed:
            assert self.store is not None  # local one-file caches are read by the dataset itself
            relative = self.index.relative_path(idx)
            data = self.store.read_all(relative)
            opened = memory_file(data, relative)
            return open_payload(f"/proc/self/fd/{opened[0]}", display, opened, remote_member(relative, len(data)))
        number, offset, length = self.index.member(idx)
        shard = self.index.shards[number]
        expected = self.index.checksum(idx)
        if self.store is None:
            try:
                path, descriptor, info = self.opener.open(shard.path, shard.path)
            except OSError as error:
                fail(shard.path, "file", f"cannot be read: {error.strerror or error}")
            return open_checked(path, descriptor, info, shard.nbytes, shard.path, display, (offset, length), expected)
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


def remote_member(relative: str, size: int) -> tuple[int, int] | None:
    """Read a remote `.safetensors` file as one member spanning the whole memory file; `.pt` by its format."""
    return (0, size) if relative.endswith(".safetensors") else None


def open_checked(
    path: str | Path,
    descriptor: int,
    info: os.stat_result,
    size: int,
    shard: str,
    display: str,
    member: tuple[int, int],
    checksum: int | None = None,
) -> OpenPayload:
    """Open a member of a local shard after checking the shard's size against the manifest and the member's checksum."""
    try:
        if info.st_size != size:
            fail(shard, "bytes", f"shard is {info.st_size} bytes, the manifest says {size} (truncated or replaced)")
        if checksum is not None:
            offset, length = member
            try:
                data = os.pread(descriptor, length, offset)
            except OSError as error:
                fail(display, "file", f"cannot be read: {error.strerror or error}")
            check_member_bytes(data, checksum, display, f"read from {path}")
    except BaseException:
        os.close(descriptor)
        raise
    return open_payload(path, display, (descriptor, info), member)
