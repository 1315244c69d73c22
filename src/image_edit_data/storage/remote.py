"""fsspec URLs: one lazily created filesystem per process, bounded retries with backoff, request counters.

A `RemoteStore` is what a dataset holds for a cache at a URL (`s3://`, `gs://`, `az://`, `hf://`,
`file://`, ...). It pickles without its filesystem and creates a fresh one the first time it is
used in each process: an s3fs client inherited through `fork` shares its parent's event loop and
connection pool and can hang, so a worker never touches the parent's client. fsspec's instance
cache is skipped for the same reason.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
# Errors that mean the object is not there or not ours to read: retrying cannot help.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether `location` names a cache through an fsspec protocol (`scheme://...`) rather than a local path."""
    text = os.fspath(location)
    return "://" in text and text.split("://", 1)[0].replace("+", "").replace("-", "").isalnum()


def join_url(base: str, relative: str) -> str:
    """`base/relative` for a URL (POSIX separators, one slash between)."""
    return f"{base.rstrip('/')}/{relative.lstrip('/')}"


@dataclass
class RetryPolicy:
    """How often and how patiently a failed request is repeated."""

    attempts: int = 4
    """Tries per request, the first included."""
    base_delay: float = 0.2
    """Seconds before the first retry; doubled each time, with +-50% jitter."""
    max_delay: float = 5.0
    """Longest wait between two tries."""

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


class RemoteError(OSError):
    """A request to a remote cache failed for good; the message names the URL and what was asked."""


@dataclass
class RequestStats:
    """Requests made and bytes fetched by this process (for benchmarks and logs); safe to count from threads."""

    requests: int = 0
    bytes_fetched: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, requests: int = 0, nbytes: int = 0) -> None:
        """Add to the counters."""
        with self._lock:
            self.requests += requests
            self.bytes_fetched += nbytes

    def __getstate__(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes_fetched": self.bytes_fetched}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(**state)  # type: ignore[misc]


@dataclass
class RemoteStore:
    """A cache location as a URL plus the fsspec storage options to reach it.

    `latency` adds a sleep before every request, to measure how reads behave on a slow link.
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    latency: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)
    _fs: Any = field(default=None, repr=False, compare=False)
    _pid: int = field(default=-1, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    @property
    def protocol(self) -> str:
        """The URL scheme (`s3`, `file`, ...)."""
        return self.url.split("://", 1)[0]

    @property
    def fs(self) -> Any:
        """This process's filesystem, created on first use in it."""
        with self._lock:  # a batch's concurrent requests must not each make a client
            if self._fs is None or self._pid != os.getpid():
                import fsspec  # the [remote] extra; local caches never import it

                options = {"skip_instance_cache": True, **self.storage_options}
                self._fs = fsspec.filesystem(self.protocol, **options)
                self._pid = os.getpid()
            return self._fs

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"], state["_pid"] = None, -1  # each process makes its own client
        state["stats"] = RequestStats()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def url_of(self, relative: str) -> str:
        """The URL of a file named relative to the cache root."""
        return join_url(self.url, relative)

    def call(self, what: str, url: str, request: Callable[[], T]) -> T:
        """Run one request with bounded retries; a permanent error or the last failure names `url`."""
        for attempt in range(1, self.retry.attempts + 1):
            if self.latency:
                time.sleep(self.latency)
            self.stats.count(requests=1)
            try:
                return request()
            except PERMANENT as error:
                if isinstance(error, FileNotFoundError):
                    raise FileNotFoundError(f"{url}: does not exist ({what})") from error
                raise RemoteError(f"{url}: {what} failed: {type(error).__name__}: {error}") from error
            except Exception as error:  # network stacks raise many types; all are worth another try
                if attempt == self.retry.attempts:
                    raise RemoteError(
                        f"{url}: {what} failed after {attempt} attempts: {type(error).__name__}: {error}"
                    ) from error
                pause = self.retry.delay(attempt)
                log.warning("%s: %s failed (%s); retrying in %.2fs", url, what, error, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")  # the loop returns or raises

    def read_range(self, relative: str, start: int, length: int) -> bytes:
        """`length` bytes of a cache file from `start`, in one request; fewer bytes is an error naming the URL."""
        url = self.url_of(relative)
        what = f"reading bytes [{start}, {start + length})"
        data = self.call(what, url, lambda: self.fs.cat_file(url, start=start, end=start + length))
        if len(data) != length:
            raise RemoteError(
                f"{url}: reading bytes [{start}, {start + length}) returned {len(data)} bytes; "
                "the object is shorter than the index says (truncated or replaced)"
            )
        self.stats.count(nbytes=length)
        return bytes(data)

    def read_all(self, relative: str) -> bytes:
        """A whole cache file."""
        url = self.url_of(relative)
        data = bytes(self.call("reading", url, lambda: self.fs.cat_file(url)))
        self.stats.count(nbytes=len(data))
        return data

    def size(self, relative: str) -> int:
        """Size in bytes of a cache file."""
        url = self.url_of(relative)
        info = self.call("looking up the size", url, lambda: self.fs.info(url))
        return int(info["size"])

    def download(self, relative: str, write: Callable[[bytes], object], chunk: int = 8 << 20) -> int:
        """Stream a whole cache file to `write`, chunk by chunk (each chunk one retried request); bytes written."""
        total = self.size(relative)
        done = 0
        while done < total:
            piece = self.read_range(relative, done, min(chunk, total - done))
            write(piece)
            done += len(piece)
        return done

    def upload(self, local: str, relative: str) -> None:
        """Copy a local file to the cache (one object: it appears whole or not at all)."""
        url = self.url_of(relative)
        self.call("uploading", url, lambda: self.fs.put_file(local, url))

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write a small cache file in one request (one object: whole or absent)."""
        url = self.url_of(relative)
        self.call("writing", url, lambda: self.fs.pipe_file(url, data))

    def exists(self, relative: str) -> bool:
        """Whether a cache file exists."""
        url = self.url_of(relative)
        return bool(self.call("checking for", url, lambda: self.fs.exists(url)))
