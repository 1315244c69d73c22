"""One interface for opening a sample's payload, whatever the layout, and the two local layouts behind it.

A `PayloadReader` opens payload `idx` (tensors still unread, owning its descriptor), names it for
errors, returns whole shards for `cache validate`, and hands the loader the prefetcher its layout
needs (only remote packed caches with a shard cache have one). `CacheLocation.open` picks the
reader: one file per sample or tar shards, on local disk (here) or at a URL (`remote_reader.py`).

Every read of a packed member is checked against its recorded checksum (index/packed.py) when the
cache has them: the member's bytes are hashed once, where the reader has them (one `pread` of the
member from a local shard, whose tensors the batch then reads from the page cache).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ..contract.paths import ContainedOpener
from ..errors import CacheFormatError, fail
from ..index.index import CacheIndex
from ..index.packed import check_member_bytes
from ..payload.payload import OpenPayload, open_payload
from .prefetch import ShardPrefetcher
from .remote import RemoteStore
from .shard_cache import ShardCache

Opened = OpenPayload | CacheFormatError  # a payload opened, or why it breaks the contract


class PayloadReader:
    """Opens the payloads of one cache layout by sample index (picklable: each worker gets its own)."""

    store: RemoteStore | None = None  # the remote store, for remote layouts
    shard_cache: ShardCache | None = None  # the node-local shard cache, for remote packed caches that use one

    def __init__(self, index: CacheIndex) -> None:
        self.index = index
        self.opener = ContainedOpener(index.root)

    def display(self, idx: int) -> str:
        """How errors name sample `idx`."""
        raise NotImplementedError

    def open(self, idx: int) -> OpenPayload:
        """Payload `idx`, opened (tensors still unread) and owning its descriptor."""
        raise NotImplementedError

    def open_many(self, indices: Sequence[int]) -> list[Opened]:
        """One batch's payloads, in order; a payload that fails the contract comes back as its error.

        Any other error (a remote store that does not answer) closes what was opened and is raised.
        Local layouts open one after the other; remote ones fetch their bytes concurrently.
        """
        return collect([functools.partial(self.open, index) for index in indices])

    def shard_bytes(self, number: int) -> bytes:
        """The whole of shard `number` of a packed cache, as stored."""
        shard = self.index.shards[number]
        _, descriptor, _ = self.opener.open(shard.path, shard.path)
        with open(descriptor, "rb", closefd=True) as stream:
            return stream.read()

    def prefetcher(self, in_flight: int) -> ShardPrefetcher | None:
        """What fetches ahead of the loader for this layout, given the batches that may be in flight (None: nothing)."""
        return None


class LocalFilesReader(PayloadReader):
    """One payload file per sample under a local cache directory (NeMo Automodel's layout)."""

    def display(self, idx: int) -> str:
        return self.index.relative_path(idx)

    def open(self, idx: int) -> OpenPayload:
        relative = self.index.relative_path(idx)
        try:
            path, descriptor, info = self.opener.open(relative, relative)
        except OSError as error:
            fail(relative, "file", f"cannot be read: {error.strerror or error}")
        return open_payload(path, relative, (descriptor, info))


class LocalPackedReader(PayloadReader):
    """Members of tar shards on local disk, each checked against its checksum."""

    def display(self, idx: int) -> str:
        return f"{self.index.shards[self.index.member(idx)[0]].path}[{self.index.relative_path(idx)}]"

    def open(self, idx: int) -> OpenPayload:
        number, offset, length = self.index.member(idx)
        shard = self.index.shards[number]
        try:
            path, descriptor, info = self.opener.open(shard.path, shard.path)
        except OSError as error:
            fail(shard.path, "file", f"cannot be read: {error.strerror or error}")
        display, expected = self.display(idx), self.index.checksum(idx)
        return open_checked(path, descriptor, info, shard.nbytes, shard.path, display, (offset, length), expected)


def collect(openers: Sequence[Callable[[], OpenPayload]]) -> list[Opened]:
    """Run each opener in order, keeping contract errors in place; any other error closes what was opened."""
    results: list[Opened] = []
    try:
        for opener in openers:
            try:
                results.append(opener())
            except CacheFormatError as error:
                results.append(error)
        return results
    except BaseException:
        close_opened(results)
        raise


def close_opened(results: Sequence[Opened | None]) -> None:
    """Close every payload among `results`."""
    for result in results:
        if isinstance(result, OpenPayload):
            result.close()


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
