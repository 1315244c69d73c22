"""The cache contract's error type, the error of a read that failed outside the bytes, and how messages show values.

Every error type of the package can be made from its message alone: torch rebuilds an error a loader
worker raised as `type(error)(message)`, a message that quotes the worker's traceback, and falls
back to `RuntimeError` for a type that cannot be made so. The types with fields read them back from
the quoted message (`message_parts`).
"""

from __future__ import annotations

import errno
from typing import NoReturn

MAX_PROBLEM_CHARS = 1000  # a hostile value must not turn an error message into megabytes
MAX_SHOWN_CHARS = 200


class CacheFormatError(ValueError):
    """A cache file breaks the contract; names the file and the field.

    Made from its parts, `CacheFormatError(file, field, problem)`, or from one message
    (`"file: field: problem"`, or torch's report of a worker's error quoting it).
    """

    def __init__(self, file: str, field: str | None = None, problem: str | None = None) -> None:
        if field is None and problem is None:
            message = file
            file, field, problem = message_parts(message, type(self), 3)
        else:
            message = f"{file}: {field}: {problem}"
        super().__init__(message)
        self.file = file
        self.field = field or ""
        self.problem = problem or ""


class CacheReadError(OSError):
    """A cache file could not be read for a reason outside its bytes, after retries; names the file.

    An I/O error, too many open files, a stale handle or a timeout says nothing about the sample:
    it is retried and then raised, never skipped or quarantined as a corrupt sample, so the set of
    skipped samples stays a property of the cache's bytes and a resume over skips stays exact.
    Made from its parts, `CacheReadError(file, problem)`, or from one message (`"file: problem"`).
    """

    def __init__(self, file: str, problem: str | None = None) -> None:
        if problem is None:
            message = file
            file, problem = message_parts(message, type(self), 2)
        else:
            message = f"{file}: {problem}"
        super().__init__(message)
        self.file = file
        self.problem = problem


def message_parts(message: str, error_type: type[BaseException], count: int) -> list[str]:
    """The `count` parts of an `error_type` message, `"part: part: rest"`, read from `message`.

    `message` is the error's own, or torch's report of a loader worker's error, which quotes the
    worker's traceback, whose last entry is `module.ErrorType: <the error's own message>`. Parts
    that are missing are empty, so the message always ends up in the last one.
    """
    quoted = f"\n{error_type.__module__}.{error_type.__qualname__}: "
    at = message.rfind(quoted)
    own = message[at + len(quoted) :].rstrip("\n") if at >= 0 else message
    parts = own.split(": ", count - 1)
    return [""] * (count - len(parts)) + parts if len(parts) < count else parts


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
