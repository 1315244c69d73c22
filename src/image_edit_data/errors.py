"""The one error type of the cache contract, and how its messages show values."""

from __future__ import annotations

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
