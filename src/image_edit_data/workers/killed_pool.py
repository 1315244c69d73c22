"""What a pool whose workers were killed leaves behind for torch's shutdown, and how it is cleared.

Closing a loader ends a fork server's workers at once (they may be loading a batch nobody will take).
A worker killed inside `done_event.is_set()` dies holding the lock of the pool's done event, a lock
it shares with the training process; torch's shutdown then sets that event and waits for the lock
for ever. Every worker of the pool is dead by then, so a lock still held has a dead holder: this
releases it. It reads torch's private `_workers_done_event` (no public API reaches the event), kept
in this one module, for a hang rather than for speed; without it, or with an event of another
shape, nothing is done and torch's own shutdown runs as before.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

HOLDER_GRACE_SECONDS = 0.5  # a live holder keeps the lock for microseconds; a dead one for ever


def release_lock_of_killed_workers(iterator: Any) -> bool:
    """Release the done event's lock if a killed worker of `iterator`'s pool holds it; whether it did."""
    event = getattr(iterator, "_workers_done_event", None)
    lock = getattr(getattr(event, "_cond", None), "_lock", None)
    if lock is None or not hasattr(lock, "acquire") or not hasattr(lock, "release"):
        return False
    if lock.acquire(timeout=HOLDER_GRACE_SECONDS):
        lock.release()
        return False
    lock.release()  # a semaphore of one: any process may release it, and its holder is dead
    log.info("a killed loader worker held the pool's done-event lock; released it so the pool can shut down")
    return True
