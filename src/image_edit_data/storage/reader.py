"""One interface for opening a sample's payload, whatever the layout, and the two local layouts behind it.

A `PayloadReader` opens payload `idx` (tensors still unread, owning its descriptor), names it for
errors, returns whole shards for `cache validate`, and hands the loader the prefetcher its layout
needs (only remote packed caches with a shard cache have one). `CacheLocation.open` picks the
reader: one file per sample or tar shards, on local disk (here) or at a URL (`remote_reader.py`).

Every read of a packed member is checked against its recorded checksum (index/packed.py) when the
cache has them: the payload carries the check (`payload/member_check.py`) and the batch computes
it in the same pass that copies the member's tensors (`batch/fill.py`), so each byte is read once.
A local packed cache keeps one descriptor per shard in each process (`ShardFiles`), opened and
checked against the manifest once, instead of an open, stat and close per sample; so does a
remote one for the shards in the node's shard cache (`CachedShardFiles`).
"""

from __future__ import annotations

import functools
import os
import resource
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .._retry import with_read_retries
from ..contract.paths import ContainedOpener
from ..errors import CacheFormatError, fail, read_failed
from ..index.index import CacheIndex
from ..index.packed import ShardInfo
from ..payload.payload import OpenPayload, open_member, open_payload
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

    def close(self) -> None:
        """Close what this reader keeps open in this process (payloads opened from it must be closed first)."""


class LocalFilesReader(PayloadReader):
    """One payload file per sample under a local cache directory (NeMo Automodel's layout)."""

    def display(self, idx: int) -> str:
        return self.index.relative_path(idx)

    def open(self, idx: int) -> OpenPayload:
        relative = self.index.relative_path(idx)
        try:
            path, descriptor, info = with_read_retries(lambda: self.opener.open(relative, relative), relative)
        except OSError as error:
            read_failed(relative, error)
        return open_payload(path, relative, (descriptor, info))


class LocalPackedReader(PayloadReader):
    """Members of tar shards on local disk, each checked against its checksum as the batch reads it."""

    def __init__(self, index: CacheIndex) -> None:
        super().__init__(index)
        self.files = ShardFiles(self.opener, index.shards)

    def display(self, idx: int) -> str:
        return f"{self.index.shards[self.index.member(idx)[0]].path}[{self.index.relative_path(idx)}]"

    def open(self, idx: int) -> OpenPayload:
        number, offset, length = self.index.member(idx)
        path, descriptor = self.files.take(number)
        try:
            source = f"read from {path}"
            release = functools.partial(self.files.give_back, number)
            return open_member(
                descriptor, self.display(idx), (offset, length), self.index.checksum(idx), source, release=release
            )
        except BaseException:
            self.files.give_back(number)
            raise

    def close(self) -> None:
        self.files.close()


class ShardFiles:
    """One open descriptor per shard of a local packed cache in this process, opened and size-checked once.

    Every member read of a shard shares its descriptor (`pread` needs no file position) instead of
    opening, stating and closing the shard per sample. Payloads `take` a shard's descriptor and
    `give_back` when closed; past `limit` open shards the least recently used one that no payload
    holds is closed. Not pickled: each process (each loader worker) opens its own. A shard replaced
    after it was opened is still read as it was when opened, which is what its index describes.
    """

    def __init__(self, opener: ContainedOpener, shards: tuple[ShardInfo, ...], limit: int | None = None) -> None:
        self.opener = opener
        self.shards = shards
        self.limit = limit or open_file_budget()
        self.lock = threading.Lock()
        self.open_files: OrderedDict[int, tuple[str, int]] = OrderedDict()  # shard -> (path, descriptor), LRU order
        self.holders: dict[int, int] = {}  # shard -> payloads holding its descriptor
        self._finalizer = weakref.finalize(self, close_descriptors, self.open_files)

    def take(self, number: int) -> tuple[str, int]:
        """Shard `number` open (path, descriptor), held until `give_back`; refused if its size is not the manifest's."""
        with self.lock:
            found = self.open_files.get(number)
            if found is None:
                found = self.open_files[number] = self.opened(number)
            else:
                self.open_files.move_to_end(number)
            self.holders[number] = self.holders.get(number, 0) + 1
            self.evict()
            return found

    def give_back(self, number: int) -> None:
        """A payload is done with shard `number`'s descriptor."""
        with self.lock:
            left = self.holders[number] - 1
            if left:
                self.holders[number] = left
            else:
                del self.holders[number]

    def opened(self, number: int) -> tuple[str, int]:
        """Open shard `number` and check its size against the manifest."""
        shard = self.shards[number]
        try:
            path, descriptor, info = with_read_retries(lambda: self.opener.open(shard.path, shard.path), shard.path)
        except OSError as error:
            read_failed(shard.path, error)
        return path, checked_size(descriptor, info, shard.nbytes, shard.path)

    def evict(self) -> None:
        """Close the least recently used shards no payload holds, down to `limit` open."""
        for number in list(self.open_files):
            if len(self.open_files) <= self.limit:
                return
            if number not in self.holders:
                os.close(self.open_files.pop(number)[1])

    def close(self) -> None:
        """Close every shard (payloads still holding one must be closed first)."""
        with self.lock:
            close_descriptors(self.open_files)
            self.holders.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"opener": self.opener, "shards": self.shards, "limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["opener"], state["shards"], state["limit"])  # type: ignore[misc]


class NotCached(Exception):
    """The shard is not in the node's shard cache (read its members by ranged requests instead)."""


class CachedShardFiles(ShardFiles):
    """One open descriptor per shard of the node's shard cache in this process, for as long as it is read.

    A cached shard is complete and verified before it appears (`shard_cache.py`), and is named by
    its SHA-256, so a descriptor opened once reads the right bytes for as long as it is kept, even
    after the shard is evicted. Eviction frees no disk while a descriptor stays open, so each time
    a shard is opened, kept descriptors of evicted shards that no payload holds are closed. Recency
    for eviction is marked when a process opens a shard, not per read: the shards being read are
    pinned by the prefetcher, and pinned shards are never evicted whatever their age.

    Before a batch is read, `wait_for_downloads` waits for downloads under way (by any process on
    the node) of the batch's shards not open here yet: at most `wait` seconds per batch, and never
    twice for one download. A shard still not cached then is read by range.
    """

    REMEMBERED = 1024  # downloads remembered as waited for: a download waited for long ago has long ended

    def __init__(self, cache: ShardCache, wait: float, limit: int | None = None) -> None:
        self.cache = cache
        self.wait = wait  # longest a batch waits for downloads of its shards already in progress
        self.waits = 0  # batches that waited, in this process
        self.waited: OrderedDict[tuple[str, int], None] = OrderedDict()  # downloads waited for: (file, inode)
        super().__init__(ContainedOpener(cache.directory), cache.shards, limit)

    def opened(self, number: int) -> tuple[str, int]:
        """Open cached shard `number` (size checked against the manifest); raises `NotCached` when it is not there."""
        self.close_evicted()
        found = self.cache.open_cached(number)
        if found is None:
            raise NotCached(number)
        descriptor, info = found
        path = str(self.cache.local_path(number))
        return path, checked_size(descriptor, info, self.shards[number].nbytes, path)

    def wait_for_downloads(self, numbers: set[int]) -> None:
        """Wait (at most `wait` seconds) for the downloads in progress of shards `numbers` not open here yet,
        each download once: waiting costs less than fetching the same bytes a second time, within a bound."""
        with self.lock:
            missing = {number for number in numbers if number not in self.open_files}
        if not missing or self.wait <= 0:
            return
        downloads = {}
        for number, path in self.cache.downloads(missing).items():
            try:
                identity = (path.name, path.stat().st_ino)
            except FileNotFoundError:
                continue  # ended since it was listed
            if identity not in self.waited:
                self.waited[identity] = None
                downloads[number] = path
        while len(self.waited) > self.REMEMBERED:
            self.waited.popitem(last=False)
        if downloads:
            self.waits += 1
            self.cache.wait_for(downloads, self.wait)

    def close_evicted(self) -> None:
        """Close kept descriptors whose shard was evicted (unlinked) and that no payload holds."""
        for number, (_, descriptor) in list(self.open_files.items()):
            if number not in self.holders and os.fstat(descriptor).st_nlink == 0:
                del self.open_files[number]
                os.close(descriptor)

    def __getstate__(self) -> dict[str, Any]:
        return {"cache": self.cache, "wait": self.wait, "limit": self.limit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cache"], state["wait"], state["limit"])  # type: ignore[misc]


def checked_size(descriptor: int, info: os.stat_result, nbytes: int, shard: str) -> int:
    """`descriptor`, once its file's size is the manifest's `nbytes`; closed, and refused naming `shard`, otherwise."""
    if info.st_size != nbytes:
        os.close(descriptor)
        fail(shard, "bytes", f"shard is {info.st_size} bytes, the manifest says {nbytes} (truncated or replaced)")
    return descriptor


def close_descriptors(open_files: OrderedDict[int, tuple[str, int]]) -> None:
    """Close every descriptor in `open_files` and forget them."""
    while open_files:
        _, (_, descriptor) = open_files.popitem()
        os.close(descriptor)


def open_file_budget() -> int:
    """How many shards a reader keeps open: a quarter of this process's open-file limit, at most 256."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(4, min(256, soft // 4)) if soft != resource.RLIM_INFINITY else 256


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


def memory_file(data: bytes | bytearray | memoryview, name: str) -> tuple[int, os.stat_result]:
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
