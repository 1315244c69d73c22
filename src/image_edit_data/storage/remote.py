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

import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from .._retry import Fault, Tries, Try, describe, plural, retried
from ..errors import CacheFormatError, fail
from .object_get import (
    S3_PROTOCOLS,
    get_object,
    get_range,
    make_store,
    object_get_available,
    object_get_settings,
    runtime_usable,
)
from .remote_faults import RemoteError, remote_fault
from .secrets import redacted_url

log = logging.getLogger(__name__)
T = TypeVar("T")
Request = Callable[[float, bool], T]  # one try: (seconds it may take, whether to go through a classifying client)
MIB = 1 << 20
# Files up to this size are downloaded in one GET; larger ones in ranged parts of this size.
WHOLE_GET_BYTES = 64 << 20
# Longest a `shard_cache` reader waits for a download of a shard it needs that another process or
# thread has under way, before reading its members by range (never longer than the deadline).
DOWNLOAD_WAIT = 30.0


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

    Only this layer retries: the S3 clients' own retries (botocore's, s3fs's, obstore's) are turned
    off, so a request that always fails is tried `attempts` times, not once per layer. A try ends
    after `connect_timeout` without a connection or `read_timeout` of silence, whatever it was
    waiting for (the answer, or more of its body), and at the latest after both plus the time its
    bytes take at `min_transfer_rate`. All of a request's tries start within `deadline`. So one
    request ends, answered or raising an error that names endpoint and object, within
    `request_bound(nbytes)`; a `shard_cache` reader may first wait for another's download of the
    shard (`download_wait`, once per download and at most that long per batch): `read_bound`.
    """

    connect_timeout: float = 5.0
    """Seconds to open a connection to the endpoint."""
    read_timeout: float = 15.0
    """Seconds a connection may stay silent while a request waits for its answer or its body."""
    attempts: int = 5
    """Tries per request, the first included."""
    deadline: float = 45.0
    """Seconds within which all tries of one request start; no try starts after it."""
    base_delay: float = 0.2
    """Seconds before the first retry; doubled each time, with +-50% jitter."""
    max_delay: float = 5.0
    """Longest wait between two tries."""
    min_transfer_rate: float = float(MIB)
    """Slowest transfer (bytes per second) a try may take on top of its timeouts before it counts as stalled."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "deadline", "min_transfer_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                unit = "bytes per second" if name == "min_transfer_rate" else "seconds"
                raise ValueError(f"remote_requests.{name} must be a positive number of {unit}, got {value!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"remote_requests.attempts must be a positive integer, got {self.attempts!r}")

    @property
    def try_timeout(self) -> float:
        """Longest one try of a request moving no body may take: connecting, then waiting for the answer."""
        return self.connect_timeout + self.read_timeout

    @property
    def time_limit(self) -> float:
        """The deadline, as the retry engine reads it."""
        return self.deadline

    def transfer_allowance(self, nbytes: int) -> float:
        """Seconds a try may spend moving `nbytes` on top of its timeouts."""
        return nbytes / self.min_transfer_rate

    def try_limit(self, nbytes: int, left: float | None) -> float:
        """Wall-clock seconds the try starting now may take: its own bound, or the rest of the deadline if longer."""
        return max(self.try_timeout + self.transfer_allowance(nbytes), left or 0.0)

    @property
    def download_wait(self) -> float:
        """Longest a `shard_cache` reader waits for another's download of a shard it reads (never past the deadline)."""
        return min(DOWNLOAD_WAIT, self.deadline)

    def request_bound(self, nbytes: int) -> float:
        """Seconds within which a request for `nbytes` ends, whatever the endpoint does: the last try starts
        before the deadline and takes at most its timeouts plus its transfer allowance."""
        return self.deadline + self.try_timeout + self.transfer_allowance(nbytes)

    def read_bound(self, nbytes: int, waits: bool = False) -> float:
        """Seconds within which reading a batch's members of `nbytes` each ends (`waits`: in `shard_cache` mode)."""
        return (self.download_wait if waits else 0.0) + self.request_bound(nbytes)

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
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # credentials: never shown
    retry: RequestPolicy = field(default_factory=RequestPolicy)
    latency: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)
    _fs: Any = field(default=None, repr=False, compare=False)
    _pid: int = field(default=-1, repr=False, compare=False)
    _objects: Any = field(default=None, repr=False, compare=False)  # this process's obstore store, if any
    _objects_pid: int = field(default=-1, repr=False, compare=False)
    # Whether the endpoint answers a ranged GET as S3 does (206), which obstore needs: None until an answer showed it.
    _serves_ranges: bool | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.object_get = object_get_settings(self.url, self.storage_options) if object_get_available() else None

    def __repr__(self) -> str:
        return f"RemoteStore({redacted_url(self.url)!r}, endpoint={self.endpoint!r})"

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
                policy = self.retry
                largest_try = policy.try_timeout + policy.transfer_allowance(WHOLE_GET_BYTES)
                self._objects = make_store(self.object_get, largest_try, policy.connect_timeout, policy.read_timeout)
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
        return redacted_url(str(given)) if given else f"the default {self.protocol} endpoint"

    def call(self, what: str, url: str, request: Request[T], nbytes: int = 0) -> T:
        """Run one request within the policy's deadlines and retry budget; its failure names `url` and the endpoint.

        `request(timeout, classifying)` makes one try that gives up after `timeout` seconds (the
        policy's `try_limit`). `classifying` asks it to go through a client whose errors carry their
        status code: it is set for the rest of the request once a try failed with an error that
        says neither what it was nor its status (obstore's generic error).
        A missing object is a `FileNotFoundError` (for the reader to report as a content fault, as
        a missing local file); an answer retrying cannot change (a 4xx but 408 and 429, missing
        credentials) is a `RemoteError` at once; a transient fault is tried again within the budget,
        then is a `RemoteError`. Any other error propagates untouched, with a note naming the object.
        """
        policy, shown = self.retry, redacted_url(url)
        classifying = False

        def attempt(current: Try) -> T:
            nonlocal classifying
            classifying = classifying or current.previous is Fault.UNCLASSIFIED
            if self.latency:
                time.sleep(self.latency)
            self.stats.count(requests=1)
            return request(policy.try_limit(nbytes, current.left), classifying)

        def give_up(tries: Tries) -> BaseException:
            error = tries.error
            if tries.fault is None:
                error.add_note(f"(while {what} {shown}, endpoint {self.endpoint})")
                return error
            if tries.fault is Fault.MISSING:
                return FileNotFoundError(errno.ENOENT, f"does not exist ({what})", shown)
            if tries.fault is Fault.REFUSED:
                return RemoteError(
                    f"{shown}: {what} refused (endpoint {self.endpoint}), not tried again: {describe(error)}"
                )
            return RemoteError(
                f"{shown}: {what} failed after {plural(tries.count, 'attempt')} in {tries.spent:.1f}s (endpoint "
                f"{self.endpoint}; deadline {policy.deadline:g}s, connect {policy.connect_timeout:g}s, "
                f"read {policy.read_timeout:g}s): {describe(error)}"
            )

        return retried(attempt, policy, give_up, f"{shown}: {what}", remote_fault)

    def timed(self, method: str, *args: Any, **kwargs: Any) -> Request[Any]:
        """One try of filesystem `method`, bounded by the timeout `call` gives it.

        An asynchronous filesystem (s3fs, gcsfs, adlfs) cancels the request at the timeout itself;
        any other runs in a helper thread that is abandoned at the timeout.
        """

        def attempt(timeout: float, classifying: bool) -> Any:
            fs = self.fs
            if getattr(fs, "async_impl", False):
                return getattr(fs, method)(*args, timeout=timeout, **kwargs)
            return run_with_timeout(lambda: getattr(fs, method)(*args, **kwargs), timeout)

        return attempt

    def read_range(self, relative: str, start: int, length: int) -> bytes | memoryview:
        """`length` bytes of a cache file from `start`, in one request.

        Fewer bytes mean an object shorter than the index says (truncated or replaced): a content
        fault naming the URL, as a local shard of the wrong size is.
        """
        url = self.url_of(relative)
        what = f"reading bytes [{start}, {start + length})"
        data = self.call(what, url, self.ranged_get(url, start, length), length)
        if len(data) != length:
            fail(
                redacted_url(url),
                "bytes",
                f"{what} returned {len(data)} bytes; the object is shorter than the index says (truncated or replaced)",
            )
        self.stats.count(nbytes=length)
        return data

    def ranged_get(self, url: str, start: int, length: int) -> Request[bytes | memoryview]:
        """One try of a ranged GET: through obstore once the endpoint showed it answers ranges as S3 does (206),
        else through s3fs, whose answer shows it."""

        def attempt(timeout: float, classifying: bool) -> bytes | memoryview:
            if self._serves_ranges and not classifying and self.obstore_usable():
                return memoryview(run_with_timeout(lambda: get_range(self.objects(), url, start, length), timeout))
            if self.protocol not in S3_PROTOCOLS:
                return self.timed("cat_file", url, start=start, end=start + length)(timeout, classifying)  # type: ignore[no-any-return]
            status, data = s3_range(self.fs, url, start, length, timeout)
            self.learn_ranges(status)
            return data

        return attempt

    def learn_ranges(self, status: int) -> None:
        """Note how the endpoint answered a ranged GET: 206 as S3 does, or 200 (`rclone serve s3`), which obstore
        refuses, so that this store's ranged reads stay on s3fs."""
        serves = status == 206
        if self._serves_ranges is None and not serves and self.object_get is not None:
            log.warning(
                "%s answered a ranged GET with status %d, not 206; ranged reads of %s go through s3fs",
                self.endpoint,
                status,
                redacted_url(self.url),
            )
        self._serves_ranges = serves if self._serves_ranges is None else self._serves_ranges and serves

    def read_all(self, relative: str, nbytes: int = 0) -> bytes:
        """A whole cache file in one request, as bytes (`nbytes`, when known, extends the try's deadline)."""
        data = self.fetch(relative, nbytes)
        return data if isinstance(data, bytes) else bytes(data)

    def fetch(self, relative: str, nbytes: int = 0) -> Any:
        """A whole cache file in one request, as a buffer (`nbytes`, when known, extends the try's deadline).

        On S3 through obstore where it may run (its buffer, not a copy: `object_get.py`), else through fsspec.
        """
        url = self.url_of(relative)
        by_fsspec = self.timed("cat_file", url)

        def attempt(timeout: float, classifying: bool) -> Any:
            if not classifying and self.obstore_usable():
                return run_with_timeout(lambda: get_object(self.objects(), url), timeout)
            return by_fsspec(timeout, classifying)

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
        caller's to refuse. `write` may raise to stop the download between two pieces.
        """
        total = self.size(relative) if size is None else size
        if total <= part:
            data = self.fetch(relative, total)
            write(data)
            return len(data)
        done = 0
        while done < total:
            try:
                piece = self.read_range(relative, done, min(part, total - done))
            except CacheFormatError:
                return done  # the object ends sooner: the caller refuses a file of the wrong size
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


def s3_range(fs: Any, url: str, start: int, length: int, timeout: float) -> tuple[int, bytes]:
    """One ranged GET through s3fs's client: the answer's status code (206, or 200 from an endpoint that answers
    ranges as whole objects) and the range's bytes."""
    import fsspec.asyn

    bucket, key, version = fs.split_path(url)
    extra = {"VersionId": version} if version else {}

    async def get() -> tuple[int, bytes]:
        answer = await fs._call_s3(  # fsspec's async form of `call_s3`
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}", **extra
        )
        body = answer["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return int(answer["ResponseMetadata"]["HTTPStatusCode"]), data

    status, data = fsspec.asyn.sync(fs.loop, get, timeout=timeout)
    if status == 200 and len(data) > length:  # the whole object: the endpoint ignored the range
        data = data[start : start + length]
    return status, data


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
