"""The package's public error types, and an instance of any error type built as the package builds it."""

from __future__ import annotations

import inspect

from image_edit_data import (
    CacheFormatError,
    CacheReadError,
    RemoteError,
    ResumeMismatchError,
    TooManyCorruptSamplesError,
)
from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.workers import LoaderWorkerTimeoutError

PUBLIC: list[type[Exception]] = [
    CacheFormatError,
    CacheReadError,
    RemoteError,
    ResumeMismatchError,
    TooManyCorruptSamplesError,
    LoaderWorkerTimeoutError,
    BadSampleError,
]
# Fields a class keeps that its message does not say, so an error rebuilt from the message cannot have them.
NOT_IN_MESSAGE = {"BadSampleError": {"kind"}}


def example(cls: type[BaseException]) -> BaseException:
    """An instance built as the package builds it: a distinct string per positional argument of the constructor.

    The first is a path with a space, the last a problem with ": " in it, as real files and problems are.
    """
    if not inspect.isfunction(cls.__init__):  # the built-in constructor: one message
        return cls(f"{cls.__name__}: what went wrong, with a path /tmp/x and a value 42")
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # after `self`
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in positional]
    values = [f"<{name}>.field[0]" for name in names]
    values[0], values[-1] = f"/cache dir/<{names[0]}>.pt", f"<{names[-1]}>: expected 3, got 4"
    return cls(*values)


def kept_fields(error: BaseException) -> dict[str, object]:
    """The fields of `error` that its message carries."""
    return {k: v for k, v in vars(error).items() if k not in NOT_IN_MESSAGE.get(type(error).__name__, set())}
