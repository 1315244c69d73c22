"""fsspec URLs: one lazily created filesystem per process, deadlines and one retry budget per request, counters.

A `RemoteStore` is what a dataset holds for a cache at a URL (`s3://`, `gs://`, `az://`, `hf://`,
`file://`, ...). It pickles without its filesystem and creates a fresh one the first time it is
used in each process: an s3fs client inherited through `fork` shares its parent's event loop and
connection pool and can hang, so a worker never touches the parent's client. fsspec's instance
cache is skipped for the same reason. On S3, shard downloads and ranged reads go through obstore
instead where it reaches the bucket as s3fs would (`object_get.py`), its store likewise made in each
process.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .object_get import (
    S3_PROTOCOLS,
    RangeNotServed,
    get_object,
    get_range,
    make_store,
    object_get_available,
    object_get_settings,
    runtime_usable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# The slowest transfer a try waits for: a request moving N bytes may take N / MIN_TRANSFER_RATE seconds
# beyond its connect and read deadlines before it counts as stalled.
MIN_TRANSFER_RATE = 1 << 20
# Files up to this size are downloaded in one GET; larger ones in ranged parts of this size.
WHOLE_GET_BYTES = 64 << 20
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
class RequestPolicy:
    """Deadlines and the one retry budget of every request to a remote cache (configurable per cache).

    Only this layer retries: the S3 client's own retries (botocore's and s3fs's) are turned off, so
    a request that always fails is tried `attempts` times, not once per layer. Each try is bounded
    by the connect and read deadlines, and all of a request's tries together by `deadline`: a silent
    endpoint is an error naming the endpoint and the object within `deadline` seconds (plus one
    try's deadline at most), whether the reader runs in the training process or in a worker.
    """

    connect_timeout: float = 5.0
    """Seconds to open a connection to the endpoint."""
    read_timeout: float = 15.0
    """Seconds a connection may stay silent while a request waits for its answer or its body."""
    attempts: int = 5
    """Tries per request, the first included."""
    deadline: float = 45.0
    """Seconds all tries of one request may take together; no try starts after it."""
    base_delay: float = 0.2
    """Seconds before the first retry; doubled each time, with +-50% jitter."""
    max_delay: float = 5.0
    """Longest wait between two tries."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"remote_requests.{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"remote_requests.attempts must be a positive integer, got {self.attempts!r}")

    @property
    def try_timeout(self) -> float:
        """Longest one try may take: connecting, then waiting for the answer."""
        return self.connect_timeout + self.read_timeout

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)

    @classmethod
    def of(cls, given: RequestPolicy | Mapping[str, Any] | None) -> RequestPolicy:
        """`given` as a policy (a dict comes from YAML, a checkpoint or a Python caller; None: the defaults)."""
        if given is None:
            return cls()
        if isinstance(given, RequestPolicy):
            return given
        if not isinstance(given, Mapping):
            raise ValueError(f"remote_requests: expected a mapping of deadlines and attempts, got {given!r:.200}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"remote_requests: unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**given)


class RemoteError(OSError):
    """A request to a remote cache failed for good; the message names the URL and what was asked.

    Raised for the endpoint or the connection (a deadline, an error answer, a broken body), never
    for the bytes a cache holds: the corrupt-sample policy does not apply to it.
    """


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
    retry: RequestPolicy = field(default_factory=RequestPolicy)
    latency: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)
    _fs: Any = field(default=None, repr=False, compare=False)
    _pid: int = field(default=-1, repr=False, compare=False)
    _objects: Any = field(default=None, repr=False, compare=False)  # this process's obstore store, if any
    _objects_pid: int = field(default=-1, repr=False, compare=False)
    _ranges_by_obstore: bool = field(default=True, repr=False, compare=False)  # False once the endpoint refused
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.object_get = object_get_settings(self.url, self.storage_options) if object_get_available() else None

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

                options = {
                    "skip_instance_cache": True,
                    **client_options(self.protocol, self.storage_options, self.retry),
                }
                self._fs = fsspec.filesystem(self.protocol, **options)
                if self.protocol in S3_PROTOCOLS:
                    self._fs.retries = 1  # s3fs's own retry loop: only `call` retries
                    self._fs.connect()  # the client now, not in the first request's deadline (no request is sent)
                self._pid = os.getpid()
            return self._fs

    def obstore_usable(self) -> bool:
        """Whether this process sends this store's S3 GETs through obstore (`object_get.py`) rather than s3fs."""
        return self.object_get is not None and runtime_usable()

    def objects(self) -> Any:
        """This process's obstore store for S3 GETs (`object_get.py`), created on first use in it."""
        with self._lock:
            if self._objects is None or self._objects_pid != os.getpid():
                assert self.object_get is not None
                largest_try = self.retry.try_timeout + transfer_allowance(WHOLE_GET_BYTES)
                self._objects = make_store(self.object_get, largest_try, self.retry.connect_timeout)
                self._objects_pid = os.getpid()
            return self._objects

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"], state["_pid"] = None, -1  # each process makes its own client
        state["_objects"], state["_objects_pid"] = None, -1
        state["stats"] = RequestStats()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def url_of(self, relative: str) -> str:
        """The URL of a file named relative to the cache root."""
        return join_url(self.url, relative)

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to, for messages: the configured one, or the protocol's default."""
        options = self.storage_options
        given = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
        return str(given) if given else f"the default {self.protocol} endpoint"

    def call(self, what: str, url: str, request: Callable[[float], T], nbytes: int = 0) -> T:
        """Run one request within the policy's deadlines and retry budget; its failure names `url` and the endpoint.

        `request(timeout)` makes one try that gives up after `timeout` seconds: the rest of the
        deadline, and at least one try's deadlines plus time to move `nbytes` at `MIN_TRANSFER_RATE`.
        """
        policy = self.retry
        started = time.monotonic()
        for attempt in range(1, policy.attempts + 1):
            if self.latency:
                time.sleep(self.latency)
            self.stats.count(requests=1)
            left = policy.deadline - (time.monotonic() - started)
            try:
                return request(max(policy.try_timeout + transfer_allowance(nbytes), left))
            except PERMANENT as error:
                if isinstance(error, FileNotFoundError):
                    raise FileNotFoundError(f"{url}: does not exist ({what})") from error
                raise RemoteError(f"{url}: {what} failed: {type(error).__name__}: {error}") from error
            except Exception as error:  # network stacks raise many types; all are worth another try
                pause = policy.delay(attempt)
                spent = time.monotonic() - started
                if attempt == policy.attempts or spent + pause >= policy.deadline:
                    raise RemoteError(
                        f"{url}: {what} failed after {attempt} attempts in {spent:.1f}s (endpoint "
                        f"{self.endpoint}; deadline {policy.deadline:g}s, connect {policy.connect_timeout:g}s, "
                        f"read {policy.read_timeout:g}s): {describe(error)}"
                    ) from error
                log.warning("%s: %s failed (%s); retrying in %.2fs", url, what, describe(error), pause)
                time.sleep(pause)
        raise AssertionError("unreachable")  # the loop returns or raises

    def timed(self, method: str, *args: Any, **kwargs: Any) -> Callable[[float], Any]:
        """One try of filesystem `method`, bounded by the timeout `call` gives it.

        An asynchronous filesystem (s3fs, gcsfs, adlfs) cancels the request at the timeout itself;
        any other runs in a helper thread that is abandoned at the timeout.
        """

        def attempt(timeout: float) -> Any:
            fs = self.fs
            if getattr(fs, "async_impl", False):
                return getattr(fs, method)(*args, timeout=timeout, **kwargs)
            return run_with_timeout(lambda: getattr(fs, method)(*args, **kwargs), timeout)

        return attempt

    def read_range(self, relative: str, start: int, length: int) -> bytes | memoryview:
        """`length` bytes of a cache file from `start`, in one request; fewer bytes is an error naming the URL."""
        url = self.url_of(relative)
        what = f"reading bytes [{start}, {start + length})"
        data = self.call(what, url, self.ranged_get(url, start, length), length)
        if len(data) != length:
            raise RemoteError(
                f"{url}: reading bytes [{start}, {start + length}) returned {len(data)} bytes; "
                "the object is shorter than the index says (truncated or replaced)"
            )
        self.stats.count(nbytes=length)
        return data  # type: ignore[no-any-return]

    def ranged_get(self, url: str, start: int, length: int) -> Callable[[float], bytes | memoryview]:
        """One try of a ranged GET: through obstore where this endpoint serves its ranges, else through s3fs."""
        by_s3fs = self.timed("cat_file", url, start=start, end=start + length)
        if not (self._ranges_by_obstore and self.obstore_usable()):
            return by_s3fs

        def attempt(timeout: float) -> bytes | memoryview:
            try:
                return memoryview(run_with_timeout(lambda: get_range(self.objects(), url, start, length), timeout))
            except RangeNotServed as error:
                self._ranges_by_obstore = False
                log.warning(
                    "%s answered a ranged GET with a whole-object status (%s); ranged reads go through s3fs",
                    self.endpoint,
                    error,
                )
                return by_s3fs(timeout)  # type: ignore[no-any-return]

        return attempt

    def read_all(self, relative: str, nbytes: int = 0) -> bytes:
        """A whole cache file in one request (`nbytes`, when known, extends the try's deadline for the transfer)."""
        url = self.url_of(relative)
        data = bytes(self.call("reading", url, self.timed("cat_file", url), nbytes))
        self.stats.count(nbytes=len(data))
        return data

    def get_object(self, relative: str, nbytes: int) -> Any:
        """A whole cache file in one GET through obstore (a buffer, not a copy): see `object_get.py`."""
        url = self.url_of(relative)

        def attempt(timeout: float) -> Any:
            return run_with_timeout(lambda: get_object(self.objects(), url), timeout)

        data = self.call("reading", url, attempt, nbytes)
        self.stats.count(nbytes=len(data))
        return data

    def size(self, relative: str) -> int:
        """Size in bytes of a cache file."""
        url = self.url_of(relative)
        info = self.call("looking up the size", url, self.timed("info", url))
        return int(info["size"])

    def download(
        self, relative: str, write: Callable[[Any], object], size: int | None = None, part: int = WHOLE_GET_BYTES
    ) -> int:
        """Move a whole cache file to `write` (bytes or another buffer, one or more pieces); the bytes written.

        A file of at most `part` bytes (a packed cache's usual shard) takes one GET: on S3 every
        request costs a round trip, and an endpoint may read the whole object to answer a ranged one.
        A larger file goes in ranged requests of `part` bytes, so no try holds more than that in memory.
        `size` (from the index) saves asking the endpoint for it; a file of another size is the
        caller's to refuse.
        """
        total = self.size(relative) if size is None else size
        if total <= part:
            data = self.get_object(relative, total) if self.obstore_usable() else self.read_all(relative, total)
            write(data)
            return len(data)
        done = 0
        while done < total:
            piece = self.read_range(relative, done, min(part, total - done))
            write(piece)
            done += len(piece)
        return done

    def upload(self, local: str, relative: str) -> None:
        """Copy a local file to the cache (one object: it appears whole or not at all)."""
        url = self.url_of(relative)
        self.call("uploading", url, self.timed("put_file", local, url), os.path.getsize(local))

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write a small cache file in one request (one object: whole or absent)."""
        url = self.url_of(relative)
        self.call("writing", url, self.timed("pipe_file", url, data), len(data))

    def exists(self, relative: str) -> bool:
        """Whether a cache file exists."""
        url = self.url_of(relative)
        return bool(self.call("checking for", url, self.timed("exists", url)))


def transfer_allowance(nbytes: int) -> float:
    """Seconds a try may spend moving `nbytes` on top of its deadlines."""
    return nbytes / MIN_TRANSFER_RATE


def client_options(protocol: str, storage_options: Mapping[str, Any], policy: RequestPolicy) -> dict[str, Any]:
    """The filesystem's options with the policy's socket deadlines, and (S3) botocore's own retries off.

    On S3, botocore's CRC check of whole-object answers is off too: every shard download is hashed
    against the manifest and every member read against its checksum, so the CRC would be a second
    pass over the same bytes (5-10 ms of CPU per 32 MiB shard: `benchmarks/s3_client.py`).
    Options the user set in `storage_options` win, `config_kwargs` key by key.
    """
    options = dict(storage_options)
    if protocol in S3_PROTOCOLS:
        ours = {
            "connect_timeout": policy.connect_timeout,
            "read_timeout": policy.read_timeout,
            "retries": {"total_max_attempts": 1},
            "response_checksum_validation": "when_required",
        }
        options["config_kwargs"] = {**ours, **(options.get("config_kwargs") or {})}
    return options


def run_with_timeout(request: Callable[[], T], timeout: float) -> T:
    """`request()` in a helper thread, or a `TimeoutError` after `timeout` seconds (the thread is abandoned)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, request()))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))

    helper = threading.Thread(target=run, name="remote-request", daemon=True)
    helper.start()
    helper.join(timeout)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout:.1f}s")
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value  # type: ignore[no-any-return]


def describe(error: BaseException) -> str:
    """An error as `Type: message`, its cause's too when the message is empty (timeouts often are)."""
    text = str(error)
    if not text and error.__cause__ is not None:
        text = f"({type(error.__cause__).__name__}: {error.__cause__})"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
