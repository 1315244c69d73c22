"""The shard cache's pins are one process's shared state: read and changed under one lock.

The prefetcher's download threads make budget decisions (`reserve`) that read this process's pins
while the sampler's thread changes them (`pin`); reading a dict that another thread resizes fails.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from image_edit_data.index.packed import ShardInfo
from image_edit_data.storage.remote import RemoteStore
from image_edit_data.storage.shard_cache import ShardCache


def shard_cache(tmp_path: Path, count: int = 3) -> ShardCache:
    source = tmp_path / "remote"
    source.mkdir()
    shards = []
    for number in range(count):
        data = bytes([number]) * 1024
        (source / f"{number}.tar").write_bytes(data)
        shards.append(ShardInfo(f"{number}.tar", len(data), hashlib.sha256(data).hexdigest()))
    return ShardCache(RemoteStore(f"file://{source}"), tuple(shards), tmp_path / "cache", 2 * 1024)


def test_a_budget_decision_reads_the_pins_under_the_lock_that_pinning_takes(tmp_path: Path) -> None:
    cache = shard_cache(tmp_path)
    cache.pin({0, 1})
    decided = threading.Event()

    def reserve() -> None:
        cache.reserve(2)
        decided.set()

    with cache._lock:  # as `pin()` holds it while it changes the pins
        deciding = threading.Thread(target=reserve)
        deciding.start()
        assert not decided.wait(0.5), "reserve() read the pins while pin() could be changing them"
    deciding.join(10)
    assert decided.is_set()
    cache.close()
    assert cache.pinned() == set()
