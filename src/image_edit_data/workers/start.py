"""How loader workers start: the multiprocessing context, and what a fork-free server loads once."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys
from multiprocessing.context import BaseContext
from typing import Literal

WorkerStart = Literal["forkserver", "spawn", "fork"]
WORKER_STARTS: tuple[WorkerStart, ...] = ("forkserver", "spawn", "fork")
# "forkserver": workers are forked from a small single-threaded server, never from the training
# process and its threads; the pool starts once per loader (docs/performance.md#worker-start-up).
DEFAULT_WORKER_START: WorkerStart = "forkserver"
# Imported once by the fork server, so each worker it forks starts with them loaded.
READ_PATH_MODULES = ["torch", "image_edit_data.dataset", "image_edit_data.batch.collate"]


# Imported by the server too when the training process has them: a worker that runs the main script
# again then finds them loaded rather than importing them itself.
FRAMEWORKS = ["lightning.pytorch"]


def server_preload() -> list[str]:
    """What the fork server imports once, so that each worker it forks starts with it loaded.

    Each worker of a fork-free start runs the main module's top level again (as spawn does), which
    is cheap only if what it imports is loaded already: the server imports the read path and the
    frameworks the training process uses. (Importing a `python -m` main module itself in the server
    would make runpy warn in every worker.)
    """
    loaded = [name for name in FRAMEWORKS if name in sys.modules]
    return ["__main__", *READ_PATH_MODULES, *loaded]


def start_failure_hint(start: WorkerStart) -> str:
    """What to check when a worker of a fork-free start dies before it answers."""
    if start == "fork":
        return ""
    return (
        f"; with multiprocessing_context={start!r} each worker runs the main script's top level again, so keep "
        "the code that trains under `if __name__ == '__main__':` (or set multiprocessing_context='fork')"
    )


def worker_context(start: WorkerStart) -> BaseContext:
    """The multiprocessing context workers start with (the fork server preloads torch and the read path)."""
    if start not in WORKER_STARTS:
        raise ValueError(f"multiprocessing_context must be one of {WORKER_STARTS}, got {start!r}")
    context = multiprocessing.get_context(start)
    if start == "forkserver":
        # Takes effect only if this process has not started its fork server yet; harmless otherwise.
        context.set_forkserver_preload(server_preload())  # type: ignore[attr-defined]
    return context


def start_server_early(start: WorkerStart, num_workers: int) -> None:
    """Start the fork server now, so that its imports run while the cache opens and training sets up.

    Starting it takes milliseconds; the server then imports torch and the read path in its own process
    (about a second), which would otherwise all come before the pool's first batch. Only for a
    loader with workers started by the fork server (the default).
    """
    if start == "forkserver" and num_workers > 0:
        worker_context(start)  # the server's preload is fixed when it starts
        multiprocessing.forkserver.ensure_running()
