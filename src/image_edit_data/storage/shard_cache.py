"""A node-local cache of whole remote shards with a byte budget, shared safely by every process on the node.

Layout of the cache directory (one per remote cache URL):
```
<sha256>.tar           a complete, verified shard (named by its hash: a replaced shard is never mistaken)
.<sha256>.<pid>.tmp    a download in progress, allocated to its full size up front so the budget counts it
<sha256>.pin           lock file: a shared flock on it pins the shard against eviction
<sha256>.damaged       verdict: the download failed its size or hash check (storage/damaged.py)
.lock                  lock file serialising budget decisions between processes
```
A shard appears only by `os.replace` after its size and hash were checked (XXH3-128 when the
manifest has it, else SHA-256: index/packed.py), so a reader never sees half of one; a failed,
stopped or killed download leaves at most its hidden temporary file, which the next process to
open the cache removes once its owner is gone. A shard whose download fails the check is
downloaded once more (bytes damaged in flight pass the second time); one that fails twice is
marked damaged for the whole node, with what was found, before its temporary file goes, and is
never downloaded again.
Eviction removes the least recently used complete shards that nobody pins; a process that already
opened a shard keeps reading it after eviction (POSIX keeps unlinked open files).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from .._process import pid_alive
from .._retry import with_read_retries
from ..index.packed import ShardInfo
from .damaged import DamagedShards, Verdict
from .remote import RemoteStore
from .secrets import redacted_url

log = logging.getLogger(__name__)


class DownloadStopped(Exception):
    """A download ended early because its owner closed (the prefetcher of a closed loader)."""


class ShardCache:
    """Whole-shard downloads of one remote packed cache into `directory`, within `budget` bytes."""

    def __init__(self, store: RemoteStore, shards: tuple[ShardInfo, ...], directory: Path, budget: int) -> None:
        largest = max(shards, key=lambda s: s.nbytes) if shards else None
        if largest is not None and largest.nbytes > budget:
            raise ValueError(
                f"shard_cache_bytes={budget} is smaller than shard {store.url_of(largest.path)} "
                f"({largest.nbytes} bytes); raise it to at least one shard (a few shards for prefetching)"
            )
        self.store = store
        self.shards = shards
        self.directory = Path(directory)
        self.budget = budget
        self.high_water = 0  # most bytes this process saw in the cache directory
        self.downloaded = 0  # bytes of the shards this process downloaded and cached
        self.downloaded_bytes = 0  # bytes this process's downloads moved, failed and repeated ones included
        self._pins: dict[int, int] = {}  # shard number -> descriptor holding its shared pin lock
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.damaged = DamagedShards(self.directory)
        self.remove_orphans()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_pins"], state["_lock"] = {}, None  # pins belong to the process that took them
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def local_path(self, number: int) -> Path:
        """Where shard `number` lives once cached."""
        return self.directory / f"{self.shards[number].sha256}.tar"

    def open_cached(self, number: int) -> tuple[int, os.stat_result] | None:
        """An open descriptor of cached shard `number` (and its stat), or None when it is not cached."""
        path = self.local_path(number)
        try:
            descriptor = with_read_retries(lambda: os.open(path, os.O_RDONLY | os.O_CLOEXEC), str(path))
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(descriptor)  # recency for eviction
        return descriptor, os.fstat(descriptor)

    def downloading(self, number: int) -> bool:
        """Whether a live process on the node is downloading shard `number` right now."""
        return number in self.downloads({number})

    def downloads(self, numbers: set[int]) -> dict[int, Path]:
        """Of shards `numbers`, those a live process on the node is downloading now, and their temporary files."""
        prefixes = {f".{self.shards[n].sha256}.": n for n in numbers}
        found: dict[int, Path] = {}
        for name in os.listdir(self.directory):
            if not (name.startswith(".") and name.endswith(".tmp")):
                continue
            prefix, _, rest = name[1:].partition(".")
            number = prefixes.get(f".{prefix}.")
            pid = rest.split(".")[0]
            if number is not None and pid.isdigit() and pid_alive(int(pid)):
                found[number] = self.directory / name
        return found

    def wait_for(self, downloads: dict[int, Path], timeout: float) -> None:
        """Return once every download of `downloads` (its temporary file) has ended, or after `timeout` seconds.

        A download ends by its rename into place (atomic: the shard appears as the file goes), by
        its failure, or with its process. Polled without a lock: a cached shard is read meanwhile.
        """
        deadline = time.monotonic() + timeout
        pause = 0.005
        left = dict(downloads)
        while left:
            for number, path in list(left.items()):
                pid = path.name.split(".")[2]
                if not path.exists() or not pid_alive(int(pid)):
                    del left[number]
            now = time.monotonic()
            if not left or now >= deadline:
                return
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, 0.05)

    @contextlib.contextmanager
    def directory_lock(self) -> Iterator[None]:
        """Exclusive lock on the whole cache directory, across processes."""
        descriptor = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)

    def pin(self, numbers: set[int]) -> None:
        """Pin exactly `numbers` for this process (shared flocks), releasing earlier pins not among them."""
        with self._lock:
            for number in set(self._pins) - numbers:
                os.close(self._pins.pop(number))
            for number in numbers - set(self._pins):
                path = self.directory / f"{self.shards[number].sha256}.pin"
                descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                fcntl.flock(descriptor, fcntl.LOCK_SH)
                self._pins[number] = descriptor

    def pinned(self) -> set[int]:
        """The shards this process pins now (a copy: `pin()` changes the pins from another thread)."""
        with self._lock:
            return set(self._pins)

    def used_bytes(self) -> tuple[int, list[tuple[float, Path, int]]]:
        """Bytes of complete shards and downloads in progress, and the complete shards as (mtime, path, size)."""
        used, complete = 0, []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tar") or entry.name.endswith(".tmp"):
                try:
                    info = entry.stat()
                except FileNotFoundError:
                    continue
                used += info.st_size
                if entry.name.endswith(".tar"):
                    complete.append((info.st_mtime, Path(entry.path), info.st_size))
        return used, complete

    def is_pinned_elsewhere(self, path: Path) -> bool:
        """Whether any process holds a pin on the shard at `path` (checked with a non-blocking exclusive lock)."""
        pin = path.with_suffix(".pin")
        try:
            descriptor = os.open(pin, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(descriptor)
        return False

    def reserve(self, number: int) -> Path | None:
        """Make room for shard `number` and allocate its temporary file; None when pinned shards fill the budget."""
        need = self.shards[number].nbytes
        with self.directory_lock():
            if self.local_path(number).exists() or self.downloading(number):
                return None  # done, or another rank or worker on the node is fetching it
            used, complete = self.used_bytes()
            mine = {str(self.local_path(n)) for n in self.pinned()}
            for _, path, size in sorted(complete):
                if used + need <= self.budget:
                    break
                if str(path) in mine or self.is_pinned_elsewhere(path):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    used -= size
            if used + need > self.budget:
                return None
            temporary = self.directory / f".{self.shards[number].sha256}.{os.getpid()}.{threading.get_ident()}.tmp"
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(descriptor, 0, need)
            finally:
                os.close(descriptor)
            self.high_water = max(self.high_water, used + need)
        return temporary

    def fetch(self, number: int, stop: threading.Event | None = None) -> bool:
        """Download shard `number` unless cached; False when the budget has no room for it now, or it is damaged.

        A download that fails its size or hash check is made once more before the shard is marked
        damaged and refused. Setting `stop` ends a download between two of its pieces (`DownloadStopped`).
        """
        if self.local_path(number).exists():
            return True
        if self.damaged.find(self.shards[number]) is not None:
            return False  # known damaged on this node: fetching it again would only find the same bytes
        temporary = self.reserve(number)
        if temporary is None:
            return self.local_path(number).exists()
        try:
            found = self.download_into(number, temporary, stop)
            if found is not None:
                log.warning("%s; downloading it once more", self.finding(number, found))
                found = self.download_into(number, temporary, stop)
            if found is not None:
                self.refuse(number, found)
            with self.directory_lock():  # a rename seen half-done by a budget count would miss the shard
                os.replace(temporary, self.local_path(number))
            self.downloaded += self.shards[number].nbytes
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()

    def download_into(self, number: int, temporary: Path, stop: threading.Event | None) -> Verdict | None:
        """Download shard `number` over `temporary`, synced to disk; what its size or hash check found, or None."""
        shard = self.shards[number]
        field, expected, digest = shard.whole_checks()[-1]
        with open(temporary, "r+b") as stream:

            def write(piece: bytes | memoryview) -> None:
                if stop is not None and stop.is_set():
                    raise DownloadStopped(self.store.url_of(shard.path))
                digest.update(piece)
                stream.write(piece)

            size = self.store.download(shard.path, write, shard.nbytes)
            self.downloaded_bytes += size
            if size != shard.nbytes:
                return Verdict("bytes", str(size), str(shard.nbytes))
            if digest.hexdigest() != expected:
                return Verdict(field, digest.hexdigest(), expected)
            stream.flush()
            os.fsync(stream.fileno())
        return None

    def finding(self, number: int, verdict: Verdict) -> str:
        """What a download of shard `number` found, naming it: its URL, the field and both values."""
        return f"{redacted_url(self.store.url_of(self.shards[number].path))}: {verdict.field}: {verdict.reason()}"

    def refuse(self, number: int, verdict: Verdict) -> NoReturn:
        """Mark shard `number` damaged for the node (before its temporary file goes), then raise naming it."""
        shard = self.shards[number]
        self.damaged.record(shard, verdict)
        what = "truncated or replaced" if verdict.field == "bytes" else "damaged or replaced"
        raise ValueError(
            f"{self.finding(number, verdict)} on two downloads ({what}); marked damaged on this node "
            f"({self.damaged.path(shard)}): no reader here uses it whole or reads it unchecked"
        )

    def remove_orphans(self) -> None:
        """Delete temporary files of downloads whose process is gone (killed mid-download)."""
        for entry in os.scandir(self.directory):
            parts = entry.name.split(".")
            ours = entry.name.startswith(".") and entry.name.endswith(".tmp") and len(parts) >= 4
            if ours and parts[2].isdigit() and not pid_alive(int(parts[2])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def close(self) -> None:
        """Release this process's pins."""
        self.pin(set())
