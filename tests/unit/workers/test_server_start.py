"""The workers' fork server starts when the process that trains opens its cache, and loads itself before any worker.

With workers, it starts when the cache opens (for the DataModule, in Lightning's `setup`, in each
rank's process), so that its imports overlap what comes before the pool; making a DataModule or a
config starts nothing. It never starts while a process re-runs its main script's top level, and a
process forked from one whose server runs (a `ddp_fork` rank) does not use that server.
`start_workers_early(wait=True)` returns once it has loaded its imports, and what it loaded is
frozen out of the garbage collector's reach before it forks.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.caches import tiny_cache

from image_edit_data.workers import start

CHILDREN = """
import os

def children() -> list[str]:
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listed:
            for pid in listed.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as command:
                    found.append(command.read().replace(b"\\0", b" ").decode())
    return found

def servers() -> int:
    return sum("multiprocessing.forkserver" in command for command in children())

def servers_soon() -> int:
    # A server is a child from the moment it starts, but its command line names the fork server only
    # once it has exec'd, which a loaded machine can delay: look for it for a few seconds.
    import time
    deadline = time.monotonic() + 10
    while servers() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return servers()
"""

OPEN = """
import sys
from image_edit_data import ImageEditDataloaderConfig

workers = int(sys.argv[2])
ImageEditDataloaderConfig(cache_dir=sys.argv[1], num_workers=workers).open_dataset()
print(servers_soon() if workers else servers())
"""

MADE = """
import os, sys
from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.lightning import ImageEditDataModule

def started() -> tuple[int, int]:
    return len(children()), len(os.listdir("/proc/self/task"))

before = started()
ImageEditDataloaderConfig(cache_dir=sys.argv[1], num_workers=2)
data = ImageEditDataModule(cache_dir=sys.argv[1], num_workers=2)
print(before == started())
data.setup("fit")
print(servers_soon())
"""

# What a process forked by the server finds: its imports, and how many objects it inherited frozen.
REPORT = """
import gc
import sys

def report(queue) -> None:
    queue.put((gc.get_freeze_count(), "torch" in sys.modules, "numpy.random" in sys.modules))
"""

WAITED = """
import sys, multiprocessing
import forked_report
from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.workers.start import worker_context

ImageEditDataloaderConfig(cache_dir=sys.argv[1], num_workers=2).start_workers_early(wait=True)
print(servers())
context = worker_context("forkserver")
queue = context.SimpleQueue()
process = context.Process(target=forked_report.report, args=(queue,))
process.start()
print(*queue.get())
process.join()
"""


def child_lines(code: str, *args: str, path: Path | None = None) -> list[str]:
    """The output lines of a fresh `python -c` running `code` (with the `servers()` helper) on `args`."""
    result = subprocess.run(
        [sys.executable, "-c", CHILDREN + code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": ":".join(str(p) for p in (ROOT / "src", path) if p), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    return result.stdout.strip().splitlines()


@pytest.mark.slow  # fresh processes start a server
def test_opening_a_cache_with_workers_starts_the_fork_server_and_without_workers_does_not(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(4,))
    assert child_lines(OPEN, str(cache), "2")[-1] == "1"
    assert child_lines(OPEN, str(cache), "0")[-1] == "0"


@pytest.mark.slow  # a fresh process imports Lightning, and its server too
def test_making_a_datamodule_or_a_config_starts_no_process_or_thread_and_its_setup_starts_the_server(
    tmp_path: Path,
) -> None:
    """Made at a script's top level, a DataModule is made again in every worker and spawned rank as it starts up,
    and in the process that forks ranks: nothing may start there."""
    cache = tiny_cache(tmp_path / "cache", counts=(4,))
    assert child_lines(MADE, str(cache))[-2:] == ["True", "1"]


def test_no_server_starts_while_a_process_runs_its_main_script_again(tmp_path: Path) -> None:
    """What a fork-free worker (or spawned rank) does as it starts: multiprocessing refuses to start processes there."""
    cache = tiny_cache(tmp_path / "cache", counts=(4,))
    rerun = "from image_edit_data import ImageEditDataloaderConfig\n"
    rerun += f"config = ImageEditDataloaderConfig(cache_dir={str(cache)!r}, num_workers=2)\n"
    rerun += "config.start_workers_early(wait=True)\nconfig.open_dataset()\n"
    code = f"exec(compile({rerun!r}, 'train.py', 'exec'), {{'__name__': '__mp_main__'}})\nprint(len(children()))"
    assert child_lines(code)[-1] == "0"


def choices_in_a_fork(queue: Any) -> None:
    """Run in a forked child: what the default and an explicit fork server choose there."""
    default = start.choose_start(None)
    try:
        start.choose_start("forkserver")
        explicit = "chosen"
    except RuntimeError as error:
        explicit = str(error)
    queue.put((default, start.uses_server(None, 2), explicit))


@pytest.mark.slow  # forks a process
def test_a_process_forked_from_one_whose_server_runs_forks_its_workers_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `ddp_fork` or `ddp_notebook` rank after the notebook opened a cache: the server is not the rank's child."""
    monkeypatch.setattr(start, "_server_owner", os.getpid())
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    child = context.Process(target=choices_in_a_fork, args=(queue,))
    child.start()
    default, uses_server, explicit = queue.get()
    child.join()
    assert default == "fork" and not uses_server
    assert f"this process was forked from process {os.getpid()}, which runs the loader workers' fork server" in explicit
    assert "let the DataModule's setup do it" in explicit
    assert start.choose_start(None) == "forkserver"  # the process that started it uses it


@pytest.mark.slow  # starts a server process
def test_a_waited_for_server_has_loaded_and_frozen_torch_before_it_forks(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(4,))
    (tmp_path / "forked_report.py").write_text(REPORT)
    servers, report = child_lines(WAITED, str(cache), path=tmp_path)[-2:]
    frozen, torch_loaded, numpy_random_loaded = report.split()
    assert servers == "1"
    assert torch_loaded == "True" and numpy_random_loaded == "True"
    assert int(frozen) > 10_000  # torch alone leaves well over a hundred thousand objects


class SlowContext:
    """A stand-in start context whose processes take `seconds` to start, or fail to."""

    def __init__(self, seconds: float, error: Exception | None = None) -> None:
        self.seconds = seconds
        self.error = error

    def Process(self, **_: Any) -> Any:  # the name multiprocessing contexts use
        context = self

        class Stalled:
            exitcode = None

            def start(self) -> None:
                time.sleep(context.seconds)
                if context.error is not None:
                    raise context.error

            def join(self) -> None:
                pass

        return Stalled()


def test_waiting_for_a_server_that_does_not_load_in_time_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(start, "worker_context", lambda _: SlowContext(2.0))
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="fork server did not load its imports within 0.1 s"):
        start.wait_for_server(0.1)
    assert time.monotonic() - began < 1.5


def test_a_server_that_cannot_start_a_process_is_an_error_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(start, "worker_context", lambda _: SlowContext(0.0, OSError("connection refused")))
    with pytest.raises(RuntimeError, match="could not start a process: connection refused"):
        start.wait_for_server(5.0)


def test_without_workers_or_with_a_fork_start_no_server_is_used() -> None:
    assert not start.uses_server(None, 0)
    assert not start.uses_server("fork", 2) and not start.uses_server("spawn", 2)
    assert start.uses_server("forkserver", 2)
