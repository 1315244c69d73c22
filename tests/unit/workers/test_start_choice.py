"""How the loader picks its workers' start method from the main module it would have to re-create (no processes)."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from image_edit_data.workers import start
from image_edit_data.workers.start import choose_start, has_main_guard, main_module_problem


def as_main(monkeypatch: pytest.MonkeyPatch, path: str | None) -> None:
    """Make `__main__` a module read from `path` (None: one without a file, as `python -c` or a notebook)."""
    main = types.ModuleType("__main__")
    if path is not None:
        main.__file__ = path
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(start, "_noted", set())


@pytest.mark.parametrize(
    ("source", "guarded"),
    [
        ('if __name__ == "__main__":\n    train()\n', True),
        ("if '__main__' == __name__:\n    train()\n", True),
        ("import sys\n\ndef main():\n    pass\n\nif __name__ == '__main__':\n    sys.exit(main())\n", True),
        ("train()\n", False),
        ('def f():\n    if __name__ == "__main__":\n        train()\n\nf()\n', False),  # not at the top level
        ('if __name__ != "__main__":\n    train()\n', False),
    ],
)
def test_a_main_guard_is_found_only_at_the_top_level(tmp_path: Path, source: str, guarded: bool) -> None:
    path = tmp_path / "script.py"
    path.write_text(source)
    assert has_main_guard(str(path)) is guarded


def test_a_guarded_script_starts_its_workers_fork_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.py"
    path.write_text('if __name__ == "__main__":\n    train()\n')
    as_main(monkeypatch, str(path))
    assert main_module_problem() is None
    assert choose_start(None) == "forkserver" and choose_start("spawn") == "spawn"


def test_without_a_usable_main_module_the_default_forks_once_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "train.py"
    path.write_text("train()\n")
    as_main(monkeypatch, str(path))
    with caplog.at_level(logging.WARNING, logger="image_edit_data.workers.start"):
        assert [choose_start(None), choose_start(None)] == ["fork", "fork"]
    assert len(caplog.records) == 1  # noted once per process
    assert 'has no `if __name__ == "__main__":` block' in caplog.records[0].getMessage()
    as_main(monkeypatch, "<stdin>")
    assert choose_start(None) == "fork"
    assert "not from a file a worker can run again" in str(main_module_problem())


@pytest.mark.parametrize("requested", ["forkserver", "spawn"])
def test_an_explicit_fork_free_start_that_cannot_work_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, requested: str
) -> None:
    as_main(monkeypatch, "<stdin>")
    with pytest.raises(RuntimeError, match=rf"multiprocessing_context='{requested}' cannot start.*<stdin>.*To fix"):
        choose_start(requested)  # type: ignore[arg-type]
    assert choose_start("fork") == "fork"  # honoured as given


def test_without_a_main_file_only_what_is_defined_in_main_needs_a_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    as_main(monkeypatch, None)  # python -c, the REPL, a notebook kernel
    assert choose_start(None, [object(), len]) == "forkserver"
    defined_here = type("DefinedHere", (), {"__module__": "__main__"})
    assert main_module_problem([defined_here()]) == "DefinedHere is defined in __main__, which has no file"
    assert choose_start(None, [defined_here()]) == "fork"


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match=r"multiprocessing_context must be one of .* or None, got 'threads'"):
        choose_start("threads")  # type: ignore[arg-type]
