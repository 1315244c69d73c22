"""The cache contract's error type, the error of a read that failed outside the bytes, and how messages show values."""

from __future__ import annotations

import errno
from typing import Any, NoReturn

MAX_PROBLEM_CHARS = 1000  # a hostile value must not turn an error message into megabytes
MAX_SHOWN_CHARS = 200


class CacheFormatError(ValueError):
    """A cache file breaks the contract; names the file and the field."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file}: {field}: {problem}")
        self.file = file
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[type[CacheFormatError], tuple[str, str, str], dict[str, Any]]:
        # Rebuilt from its three parts, not from the joined message: a worker process sends it to the
        # training process by pickle, and a bench child sends it back to the bench.
        return type(self), (self.file, self.field, self.problem), self.__dict__


class CacheReadError(OSError):
    """A cache file could not be read for a reason outside its bytes, after retries; names the file.

    An I/O error, too many open files, a stale handle or a timeout says nothing about the sample:
    it is retried and then raised, never skipped or quarantined as a corrupt sample, so the set of
    skipped samples stays a property of the cache's bytes and a resume over skips stays exact.
    """

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem

    def __reduce__(self) -> tuple[type[CacheReadError], tuple[str, str], dict[str, Any]]:
        return type(self), (self.file, self.problem), self.__dict__


# OS errors that say the file itself is absent or not a file: a property of the cache, like bad bytes.
CONTENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})


def is_transient(error: OSError) -> bool:
    """Whether an OS error may pass on a retry (EIO, EMFILE, ESTALE, ETIMEDOUT, ...), unlike a missing file."""
    absent = isinstance(error, FileNotFoundError | IsADirectoryError | NotADirectoryError)
    return not absent and error.errno not in CONTENT_ERRNOS


def read_failed(file: str, error: OSError) -> NoReturn:
    """Raise the error for an OS error reading `file`: a contract error if the file is absent, else a read error.

    A `CacheReadError` (a read that used up its tries) is raised as it is.
    """
    if isinstance(error, CacheReadError):
        raise error
    if is_transient(error):
        raise CacheReadError(file, f"cannot be read: {error.strerror or error}") from error
    fail(file, "file", f"cannot be read: {error.strerror or error}")


def fail(file: str, field: str, problem: str) -> NoReturn:
    """Raise the one error type every contract rule uses."""
    if len(problem) > MAX_PROBLEM_CHARS:
        problem = f"{problem[:MAX_PROBLEM_CHARS]}... ({len(problem)} characters)"
    raise CacheFormatError(file, field, problem)


def show(value: object) -> str:
    """`repr(value)` for an error message: bounded in length, and safe on absurdly nested values."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<{type(value).__name__} nested too deeply to show>"
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}..."
