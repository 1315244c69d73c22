"""Claim: every exception class the package defines crosses a process boundary with its message.

A loader worker or a bench child hands its error to the parent process by pickle; an error that
does not unpickle turns into "process pool terminated abruptly" or a worker's generic RuntimeError.
The classes are found by reading every module of `src/`, so a new one cannot be left out.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
from pathlib import Path

import pytest
from support import ROOT

PACKAGE = ROOT / "src" / "image_edit_data"
# The public ones, by name: the discovery below must find at least these.
PUBLIC = {
    "CacheFormatError",
    "ResumeMismatchError",
    "TooManyCorruptSamplesError",
    "LoaderWorkerTimeoutError",
    "RemoteError",
    "CacheReadError",
    "BadSampleError",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exception_classes() -> list[type[BaseException]]:
    """Every class defined at the top level of a module of the package that is an exception (warnings too)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        names = [node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)]
        if not names:
            continue
        module = importlib.import_module(module_name(path))
        for name in names:
            cls = getattr(module, name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return found


CLASSES = exception_classes()


def test_the_discovery_finds_every_public_error_type() -> None:
    assert {cls.__name__ for cls in CLASSES} >= PUBLIC


def example(cls: type[BaseException]) -> BaseException:
    """An instance built from a distinct string per required argument of the constructor."""
    if not inspect.isfunction(cls.__init__):  # the built-in constructor: one message
        return cls(f"{cls.__name__}: what went wrong, with a path /tmp/x and a value 42")
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # after `self`
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.default is p.empty and p.kind in positional]
    if not required:
        return cls(f"{cls.__name__}: what went wrong, with a path /tmp/x and a value 42")
    return cls(*(f"<{p.name}>" for p in required))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_error_type_survives_pickling_with_its_message_and_fields(cls: type[BaseException]) -> None:
    error = example(cls)
    error.add_note("a note added on the way")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)  # fields such as `file`, `field`, `problem`, and the note
