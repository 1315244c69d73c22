"""The workers' fork server collects and freezes what it loaded, once: importing this module anywhere else does nothing.

Importing torch leaves the server with a full garbage collection owed (over some 170 thousand
objects, tens of milliseconds here). Frozen, those objects are out of the collector's reach in the
server and in every worker it forks: no worker pays that collection in its first batch, and none
writes to the inherited pages that hold them (which would copy them into the worker). Workers
freeze again when they start (`watch.start_worker`), for what they received themselves.

A fork server can only import modules (`set_forkserver_preload`), so it names this module last in
its preload, and the module calls `freeze_heap()` when, and only when, the import comes from the
server's own preload loop: imported by any other process (a test, a tool listing modules), it
changes nothing.
"""

from __future__ import annotations

import gc
import inspect
import multiprocessing.forkserver


def freeze_heap() -> None:
    """Collect garbage once, then move every object left out of the collector's reach (`gc.freeze`)."""
    gc.collect()
    gc.freeze()


def imported_by_fork_server() -> bool:
    """Whether this import runs inside the fork server's preload (its `main` is on the stack)."""
    server_main = multiprocessing.forkserver.main.__code__
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is server_main:
            return True
        frame = frame.f_back
    return False


if imported_by_fork_server():
    freeze_heap()
