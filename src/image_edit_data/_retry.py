"""The one retry engine of every read, local or remote: what a fault means, and how long to keep trying.

A fault is classified by its exception type and, for an endpoint's answer, its HTTP status code;
never by its message text:
- `TRANSIENT`: another try may pass (an I/O error, a stale handle, too many open files, a timeout,
  a reset or truncated body, 408, 429, 5xx). Counting it as a corrupt sample would make the skipped
  set depend on timing and break exact resume, so it is tried again and then raised as a read error;
- `MISSING`: the file or object is not there (ENOENT and its kin, 404): a property of the cache, like
  bad bytes, and a content fault for the caller to name;
- `REFUSED`: retrying cannot help (permission denied, missing credentials, any other 4xx);
- `UNCLASSIFIED`: a client error with no type or status of its own (obstore's generic error): tried
  again, through a client that reports the status (`storage/remote.py`);
- anything else (a `TypeError`, a contract error) is not a read fault and propagates untouched, as
  does an error that already used up its own tries (a read error raised by a read nested in this one).

Every read has one budget: each try counts once, and the error names the true count.
"""

from __future__ import annotations

import enum
import errno
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar

from .errors import CONTENT_ERRNOS, CacheReadError

log = logging.getLogger(__name__)
T = TypeVar("T")
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@")  # `scheme://user:password@`
MAX_SHOWN = 300
REFUSED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
TRANSIENT_STATUS = frozenset({408, 429})  # the 4xx answers that say "try again"


class Fault(enum.Enum):
    """What a failed read means for another try (see the module docstring)."""

    TRANSIENT = "transient"
    MISSING = "missing"
    REFUSED = "refused"
    UNCLASSIFIED = "unclassified"

    @property
    def retried(self) -> bool:
        """Whether another try may pass."""
        return self in (Fault.TRANSIENT, Fault.UNCLASSIFIED)


class Budget(Protocol):
    """How often and how long one read is tried."""

    @property
    def attempts(self) -> int: ...

    @property
    def time_limit(self) -> float | None:
        """Seconds all tries may take together (no try starts after it), or None."""

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""


@dataclass(frozen=True)
class LocalReads:
    """The budget of a local read: 3 tries, 0.05 s and then 0.2 s apart."""

    attempts: int = 3
    first_pause: float = 0.05
    time_limit: float | None = None

    def delay(self, attempt: int) -> float:
        return self.first_pause * 4 ** (attempt - 1)


LOCAL_READS = LocalReads()


@dataclass(frozen=True)
class Try:
    """One try about to start: its number (1-based), the seconds left of the budget, the last try's fault."""

    number: int
    left: float | None
    previous: Fault | None


@dataclass(frozen=True)
class Tries:
    """How a read ended without a result: the tries made, the seconds spent, the last error and its fault."""

    count: int
    spent: float
    error: BaseException
    fault: Fault | None


def http_status(error: BaseException) -> int | None:
    """The HTTP status code an endpoint answered with, found on `error` or the errors it was raised from.

    botocore keeps it in `response["ResponseMetadata"]`, aiohttp in `status`, azure-core in
    `status_code`; s3fs raises an `OSError` from botocore's error, hence the walk along `__cause__`.
    """
    current: BaseException | None = error
    for _ in range(8):  # causes chain a few deep at most
        if current is None:
            return None
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        for name in ("status", "status_code"):
            code = getattr(current, name, None)
            if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
                return code
        current = current.__cause__
    return None


def fault_of_status(status: int) -> Fault:
    """What an endpoint's error answer means for another try."""
    if status == 404:
        return Fault.MISSING
    if status in TRANSIENT_STATUS or status >= 500:
        return Fault.TRANSIENT
    return Fault.REFUSED


def fault_of(error: BaseException) -> Fault | None:
    """What `error` means for another try; None: not a read fault (a bug, or a read that already gave up)."""
    if isinstance(error, CacheReadError):
        return None  # a nested read used its own tries: trying it again would multiply them
    status = http_status(error)
    if status is not None:
        return fault_of_status(status)
    if isinstance(error, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return Fault.MISSING
    if isinstance(error, PermissionError):
        return Fault.REFUSED
    if isinstance(error, TimeoutError | ConnectionError):
        return Fault.TRANSIENT
    if isinstance(error, OSError):
        if error.errno in CONTENT_ERRNOS:
            return Fault.MISSING
        if error.errno in REFUSED_ERRNOS:
            return Fault.REFUSED
        return Fault.TRANSIENT  # EIO, EMFILE, ESTALE, ETIMEDOUT, ...; or an I/O error its client did not detail
    return None


def retried(
    attempt: Callable[[Try], T],
    budget: Budget,
    give_up: Callable[[Tries], BaseException],
    name: str,
    classify: Callable[[BaseException], Fault | None] = fault_of,
) -> T:
    """`attempt(try)` until it returns, tried again after a transient fault within `budget`.

    When it cannot return, the error raised is `give_up(tries)` (from the last error), for the
    caller to word; an error that is not a read fault is raised as it is. `name` says what is read, for the log.
    """
    started = time.monotonic()
    limit = budget.time_limit
    previous: Fault | None = None
    for number in range(1, budget.attempts + 1):
        left = None if limit is None else limit - (time.monotonic() - started)
        try:
            return attempt(Try(number, left, previous))
        except Exception as error:
            fault = classify(error)
            spent = time.monotonic() - started
            if fault is None or not fault.retried or number == budget.attempts:
                end(give_up(Tries(number, spent, error, fault)), error)
            pause = budget.delay(number)
            if limit is not None and spent + pause >= limit:
                end(give_up(Tries(number, spent, error, fault)), error)
            log.warning("%s: try %d failed (%s); trying again in %.2fs", name, number, describe(error), pause)
            time.sleep(pause)
            previous = fault
    raise AssertionError("unreachable")  # the loop returns or raises


def end(final: BaseException, error: BaseException) -> NoReturn:
    """Raise `final`, from `error` unless it is `error` itself."""
    if final is error:
        raise error
    raise final from error


def with_read_retries(read: Callable[[], T], file: str, budget: Budget = LOCAL_READS) -> T:
    """`read()`, one local read, tried again after a transient OS error; a `CacheReadError` naming `file` when it
    cannot pass. A missing file's error is raised as it is, for the caller to report as a content fault."""

    def give_up(tries: Tries) -> BaseException:
        error = tries.error
        if not isinstance(error, OSError) or tries.fault in (None, Fault.MISSING):
            return error
        reason = error.strerror or describe(error)
        count = "not tried again" if tries.fault is Fault.REFUSED else f"tried {plural(tries.count, 'time')}"
        return CacheReadError(file, f"cannot be read: {reason} ({count})")

    return retried(lambda _: read(), budget, give_up, file)


def plural(count: int, noun: str) -> str:
    """`1 time`, `3 times`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def describe(error: BaseException) -> str:
    """An error as `Type: message` (its first line), its cause's too when the message is empty (timeouts often
    are); a user and password inside a URL in it are shown as `<redacted>`."""
    text = first_line(error)
    if not text and error.__cause__ is not None:
        text = f"({type(error.__cause__).__name__}: {first_line(error.__cause__)})"
    shown = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return USERINFO.sub(r"\g<scheme><redacted>@", shown)


def first_line(error: BaseException) -> str:
    """The first line of an error's message, at most `MAX_SHOWN` characters (clients append pages of debug text)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}..."
