"""How loader workers start: the start method this process's main module allows, and what a fork server loads once.

A worker started without a fork of the training process ("forkserver", "spawn") imports the main
module again, under the name `__mp_main__`: it runs the main script's top level, and it finds
there what the loader hands it by reference (a dataset class, a collate function). That works for
a script that trains under `if __name__ == "__main__":`, and for `python -c` or a notebook kernel
as long as nothing handed to workers is defined in `__main__`. It cannot work for a script without
that guard (each worker would train), for `python - < script.py` (there is no file to run again),
or for a class defined in a notebook. `choose_start` finds those cases before any worker starts.

The fork server is started by the process whose loaders use it, once it opens a cache (for the
DataModule, in Lightning's `setup`, in each rank's own process), never while a process is still
running its main module's top level (a worker, or a spawned rank, re-creating it), and never in a
process forked from one whose server runs: a server serves only the process that started it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
import types
from collections.abc import Iterable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal

log = logging.getLogger(__name__)

WorkerStart = Literal["forkserver", "spawn", "fork"]
WORKER_STARTS: tuple[WorkerStart, ...] = ("forkserver", "spawn", "fork")
# What `multiprocessing_context=None` (the default) starts with when the main module allows it:
# workers are forked from a small single-threaded server, never from the training process and its
# threads; the pool starts once per loader (docs/performance.md#worker-start-up).
DEFAULT_WORKER_START: WorkerStart = "forkserver"
# What the default falls back to, once per pool, when a fork-free start cannot re-create the main module.
FALLBACK_WORKER_START: WorkerStart = "fork"
# Imported once by the fork server, so each worker it forks starts with them loaded: the read path and the
# worker's own loop and watch (`dataloader_config` imports them all), and numpy.random, which torch's worker
# loop imports to seed it.
READ_PATH_MODULES = ["torch", "numpy.random", "image_edit_data.dataloader_config"]
# Imported by the server too when the training process has them: a worker that runs the main script
# again then finds them loaded rather than importing them itself.
FRAMEWORKS = ["lightning.pytorch"]
# Imported by the server after everything else: collects and freezes what it loaded (`server_freeze.py`).
SERVER_FREEZE = "image_edit_data.workers.server_freeze"

FIX = (
    'keep the code that trains under `if __name__ == "__main__":` in a script run by its path, and define '
    "what the loader hands its workers (dataset, collate_fn) in an importable module; or set "
    "multiprocessing_context='fork' (or leave it unset, and the loader forks its workers when it must)"
)

INHERITED_FIX = (
    "open the cache and build loaders with workers in the process that trains (with Lightning, let the "
    "DataModule's setup do it: do not call setup() or build a loader with workers before trainer.fit); or set "
    "multiprocessing_context='fork' (or leave it unset, and the loader forks its workers when it must)"
)

_noted: set[str] = set()  # fall-backs already logged by this process
# The process that started the fork server, or a pool from it, through this module. A process forked
# from it inherits this value, and with it a server it cannot use: the server is not its child.
_server_owner: int | None = None


def main_module_problem(handed: Iterable[object] = ()) -> str | None:
    """Why a fork-free worker could not re-create this process's main module for `handed`, or None when it can."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:  # `python -c`, the REPL, a notebook kernel: nothing to run again, nothing to import from
        defined = sorted({name for name in map(main_name, handed) if name is not None})
        if defined:
            return f"{', '.join(defined)} {'is' if len(defined) == 1 else 'are'} defined in __main__, which has no file"
        return None
    if not os.path.isfile(path):
        return f"the main module was read from {path!r}, not from a file a worker can run again"
    if not has_main_guard(path):
        return f'{path} has no `if __name__ == "__main__":` block, so each worker would run its training again'
    return None


def main_name(obj: object) -> str | None:
    """`obj`'s name when it (or its class) is defined in `__main__`, else None."""
    defined = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
    return defined.__qualname__ if defined.__module__ == "__main__" else None


@functools.lru_cache(maxsize=16)
def has_main_guard(path: str) -> bool:
    """Whether the script at `path` has a top-level `if __name__ == "__main__":` (True when it cannot be read)."""
    try:
        with open(path, "rb") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):  # a compiled main, say: assume the usual guard
        return True
    return any(isinstance(node, ast.If) and is_main_test(node.test) for node in tree.body)


def is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]


def choose_start(requested: WorkerStart | None, handed: Iterable[object] = ()) -> WorkerStart:
    """The start method of a pool: `requested` when given (refused if it cannot work here), else the default's choice.

    The default is "forkserver", or "fork" (logged once) when a fork-free worker could not re-create
    the main module: the pool still starts once per loader, so the training process forks once, not
    per epoch. An explicit fork-free choice that cannot work raises at once instead of leaving
    every worker to fail.
    """
    check_start(requested)
    if requested == "fork":
        return requested
    problem, fix = main_module_problem(handed), FIX
    if problem is None and requested != "spawn" and server_inherited():
        problem, fix = inherited_server_problem(), INHERITED_FIX
    if problem is None:
        return requested or DEFAULT_WORKER_START
    if requested is None and FALLBACK_WORKER_START in multiprocessing.get_all_start_methods():
        if problem not in _noted:
            _noted.add(problem)
            log.warning(
                "loader workers start with multiprocessing_context='fork' in this process: a fork-free start "
                "cannot re-create the main module here (%s)",
                problem,
            )
        return FALLBACK_WORKER_START
    chosen = requested or DEFAULT_WORKER_START
    raise RuntimeError(f"multiprocessing_context={chosen!r} cannot start loader workers here: {problem}. To fix: {fix}")


def check_start(start: WorkerStart | None) -> None:
    """Refuse an unknown start method name (None is the default's choice)."""
    if start is not None and start not in WORKER_STARTS:
        raise ValueError(f"multiprocessing_context must be one of {WORKER_STARTS} or None, got {start!r}")


def refuse_a_rerun_of_main() -> None:
    """Raise when a worker, running the main script's top level again, is about to start a pool of its own.

    That is the training code of a script that runs it outside `if __name__ == "__main__":`; failing
    here ends the worker at once with the fix named, and the training process reports the worker that
    ended before its first batch. (Building a loader there is harmless: only starting one is not.)
    """
    if importing_main():
        raise RuntimeError(f"a loader worker is running the main script's training code again. To fix: {FIX}")


def importing_main() -> bool:
    """Whether this process is running its main script's top level again, as `__mp_main__`.

    A process started without a fork (a loader worker, a spawned rank) does that while it starts up,
    before it runs what it was started for; multiprocessing refuses to start processes from there.
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def server_inherited() -> bool:
    """Whether this process was forked from one that runs the workers' fork server (which only serves that one)."""
    return _server_owner is not None and _server_owner != os.getpid()


def inherited_server_problem() -> str:
    """Why a forked process cannot start workers from the fork server it inherited."""
    return (
        f"this process was forked from process {_server_owner}, which runs the loader workers' fork server (a rank "
        "of ddp_fork or ddp_notebook, say), and a fork server serves only the process that started it"
    )


def note_server_used() -> None:
    """This process starts the fork server, or a pool from it: a process forked from it later cannot use it."""
    global _server_owner
    if _server_owner is None:
        _server_owner = os.getpid()


def start_failure_hint(start: WorkerStart | None) -> str:
    """What to check when a worker ends before it delivers its first batch."""
    if start == "fork":
        return "; the worker's own error is printed above it"
    return (
        f"; with multiprocessing_context={start!r} each worker imports the main module again, and the worker's "
        f"own error is printed above it. If it could not, {FIX}"
    )


def server_preload() -> list[str]:
    """What the fork server imports once, so that each worker it forks starts with it loaded.

    Each worker of a fork-free start runs the main module's top level again (as spawn does), which
    is cheap only if what it imports is loaded already: the server imports the read path and the
    frameworks the training process uses. Not the main module itself: CPython ignored a `__main__`
    entry until gh-126631 (3.14, and a 3.13 patch release), and since runs the script in the server
    (with an empty `sys.argv` in some releases, gh-143706); leaving it out keeps one behaviour on
    every version.
    """
    loaded = [name for name in FRAMEWORKS if name in sys.modules]
    return [*READ_PATH_MODULES, *loaded, SERVER_FREEZE]


def worker_context(start: WorkerStart) -> BaseContext:
    """The multiprocessing context workers start with (the fork server preloads torch and the read path)."""
    check_start(start)
    context = multiprocessing.get_context(start)
    if start == "forkserver":
        # Takes effect only if this process has not started its fork server yet; harmless otherwise.
        context.set_forkserver_preload(server_preload())  # type: ignore[attr-defined]
    return context


def start_server_early(start: WorkerStart | None, num_workers: int) -> bool:
    """Start the fork server now, so that its imports run while the cache opens and training sets up; whether it did.

    Starting it takes milliseconds; the server then imports torch and the read path in its own process
    (about a second), which would otherwise all come before the pool's first batch. Only for a
    loader with workers started by the fork server (the default, unless the main module cannot be
    re-created here: then the pool forks and no server is started), and only where it is safe: not
    while this process re-runs its main script's top level, nor from a server it inherited by a fork.
    """
    if not uses_server(start, num_workers) or importing_main():
        return False
    worker_context("forkserver")  # the server's preload is fixed when it starts
    multiprocessing.forkserver.ensure_running()
    note_server_used()
    return True


def uses_server(start: WorkerStart | None, num_workers: int) -> bool:
    """Whether a loader with `num_workers` workers and start method `start` would start them from the fork server."""
    if num_workers <= 0 or start not in (None, "forkserver") or server_inherited():
        return False  # no workers, a start without the server (or with one it cannot use), or a refused name
    return start == "forkserver" or main_module_problem() is None


def wait_for_server(timeout: float | None) -> None:
    """Return once the fork server (started now if it is not running) has imported its preload.

    The server forks its first process only after its imports, so this starts one process through it
    that does nothing and waits for it to end, from a thread: a server that takes longer than
    `timeout` seconds (None: no limit) raises here rather than blocking the caller.
    """
    context: Any = worker_context("forkserver")  # a ForkServerContext, typed as its base, which has no Process
    process = context.Process(target=_nothing, name="fork-server-ready", daemon=True)
    failed: list[BaseException] = []
    starting = threading.Thread(target=_start_into, args=(process, failed), name="fork-server-wait", daemon=True)
    starting.start()
    starting.join(timeout)
    if starting.is_alive():
        raise RuntimeError(f"the loader workers' fork server did not load its imports within {timeout:g} s")
    if failed:
        raise RuntimeError(f"the loader workers' fork server could not start a process: {failed[0]}") from failed[0]
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(
            f"a process started by the loader workers' fork server ended with exit code {process.exitcode}"
            f"{start_failure_hint('forkserver')}"
        )


def _start_into(process: BaseProcess, failed: list[BaseException]) -> None:
    try:
        process.start()
    except Exception as error:  # handed to the waiting thread, which raises it
        failed.append(error)


def _nothing() -> None:
    """What `wait_for_server`'s process runs (module level, so the server's child finds it by name)."""
