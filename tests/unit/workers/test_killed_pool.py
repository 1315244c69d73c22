"""Closing a loader never waits for a lock that a killed worker held."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.caches import tiny_cache

from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.workers.killed_pool import release_lock_of_killed_workers


def take_and_die(lock: Any) -> None:
    lock.acquire()
    os._exit(0)  # dies holding it, as a worker killed inside `done_event.is_set()` does


@pytest.mark.slow  # a fork server and its workers
def test_closing_a_loader_whose_done_event_lock_a_dead_process_holds_returns_at_once(
    tmp_path: Path,
) -> None:
    """The lock is taken by a forked process that exits holding it: the state a worker killed inside
    `done_event.is_set()` leaves, which made `close()` wait for ever (seen once in a suite run)."""
    cache = tiny_cache(tmp_path / "cache", counts=(8,))
    built = ImageEditDataloaderConfig(cache_dir=str(cache), num_workers=2).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    loader = built.dataloader
    next(iter(loader))
    assert loader.worker_start == "forkserver"
    lock = loader._iterator._workers_done_event._cond._lock  # torch's own, as killed_pool.py reads it
    holder = multiprocessing.get_context("fork").Process(target=take_and_die, args=(lock,))
    holder.start()
    holder.join(30)
    assert holder.exitcode == 0

    closing = threading.Thread(target=loader.close, daemon=True)
    started = time.monotonic()
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close() waits for a lock whose holder is dead"
    assert time.monotonic() - started < 10


def test_a_free_lock_or_no_pool_is_left_alone() -> None:
    assert release_lock_of_killed_workers(None) is False
    event = multiprocessing.get_context("fork").Event()

    class Pool:
        _workers_done_event = event

    assert release_lock_of_killed_workers(Pool()) is False
    event.set()  # the lock is free and still works
    assert event.is_set()
