"""Claim: every exception class the package defines reaches the process that handles it as that class.

A loader worker's error reaches the training process through torch: the worker sends the error's
type and its formatted traceback, and the training process raises `type(message)`, or a
`RuntimeError` when the type cannot be made from one message (`torch._utils.ExceptionWrapper`).
So each class must be constructible from one message and read its fields back from it; a bench
child's error comes back by pickle. The classes are found by reading every module of `src/`, so a
new one cannot be left out; the loader and the fit that take this path with real workers are in
`tests/integration/fit/test_worker_errors.py`.
"""

from __future__ import annotations

import ast
import importlib
import pickle
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.error_types import PUBLIC, example, kept_fields
from torch._utils import ExceptionWrapper

PACKAGE = ROOT / "src" / "image_edit_data"


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


def rebuilt_by_torch(error: BaseException) -> BaseException:
    """`error` as torch hands a loader worker's error to the training process (the wrapper crosses by pickle)."""
    try:
        raise error
    except BaseException:
        wrapper = pickle.loads(pickle.dumps(ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 1")))
    try:
        wrapper.reraise()
    except BaseException as rebuilt:
        return rebuilt
    raise AssertionError("ExceptionWrapper.reraise() did not raise")


def test_the_discovery_finds_every_public_error_type() -> None:
    assert set(CLASSES) >= set(PUBLIC)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_error_type_comes_out_of_torchs_worker_error_path_as_that_type_with_its_fields(
    cls: type[BaseException],
) -> None:
    error = example(cls)
    rebuilt = rebuilt_by_torch(error)
    assert type(rebuilt) is cls, f"torch raised {type(rebuilt).__name__}: {rebuilt}"
    assert isinstance(rebuilt, cls.__mro__[1])  # the built-in base (`except ValueError` keeps working)
    message = str(rebuilt)
    assert message.startswith(f"Caught {cls.__name__} in DataLoader worker process 1") and str(error) in message
    assert kept_fields(rebuilt) == kept_fields(error)  # `file`, `field`, `problem`, ...


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_error_type_made_from_its_own_message_equals_the_original(cls: type[BaseException]) -> None:
    error = example(cls)
    assert kept_fields(cls(str(error))) == kept_fields(error)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_error_type_survives_pickling_as_a_bench_childs_error_does(cls: type[BaseException]) -> None:
    error = example(cls)
    error.add_note("a note added on the way")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)  # fields such as `file`, `field`, `problem`, and the note
