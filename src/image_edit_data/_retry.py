"""Local reads tried again after a transient OS error, then raised as a read error, never as bad data.

An I/O error, a stale NFS handle, too many open files or a timeout on a network file system says
nothing about a sample's bytes. Counting it as a corrupt sample would make the skipped set depend
on timing and break exact resume, so a read that fails that way is tried again a few times and
then raised as `CacheReadError`, which the corrupt-sample policy never catches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import CacheReadError, is_transient

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_ATTEMPTS = 3
"""Tries of a local read, the first included."""
FIRST_PAUSE = 0.05
"""Seconds before the second try; four times longer before each later one."""


def retryable(error: BaseException) -> bool:
    """A transient local OS error (a remote request's error has its own retry budget and is not retried here)."""
    if isinstance(error, CacheReadError):
        return True
    return isinstance(error, OSError) and error.errno is not None and is_transient(error)


def with_read_retries(read: Callable[[], T], file: str, attempts: int = READ_ATTEMPTS) -> T:
    """`read()`, tried again after a transient OS error; a `CacheReadError` naming the file when every try failed."""
    for attempt in range(1, attempts + 1):
        try:
            return read()
        except OSError as error:
            if not retryable(error):
                raise
            name = error.file if isinstance(error, CacheReadError) else file
            if attempt == attempts:
                problem = error.problem if isinstance(error, CacheReadError) else f"cannot be read: {error.strerror}"
                raise CacheReadError(name, f"{problem} (tried {attempts} times)") from error
            pause = FIRST_PAUSE * 4 ** (attempt - 1)
            log.warning("%s: read failed (%s); trying again in %.2fs", name, error, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")  # the loop returns or raises
