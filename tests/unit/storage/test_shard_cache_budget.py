"""The node-local shard cache keeps its byte budget while several processes fetch into it at once.

Real processes race on one cache directory, as a node's loader workers and ranks do; a sampler
in this process counts the directory under the cache's own lock, the moment every budget
decision sees, so a count that misses a shard mid-rename would show as a breach.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
from pathlib import Path

from image_edit_data.index.packed import ShardInfo
from image_edit_data.storage.remote import RemoteStore
from image_edit_data.storage.shard_cache import ShardCache

SHARDS, SHARD_BYTES, BUDGET_SHARDS = 12, 64 << 10, 3


def write_shards(source: Path) -> tuple[ShardInfo, ...]:
    """Random shards under `source`, described as a packed cache's manifest would."""
    source.mkdir(parents=True)
    infos = []
    for number in range(SHARDS):
        data = os.urandom(SHARD_BYTES)
        (source / f"{number}.tar").write_bytes(data)
        infos.append(ShardInfo(f"{number}.tar", SHARD_BYTES, hashlib.sha256(data).hexdigest()))
    return tuple(infos)


def open_cache(source: Path, shards: tuple[ShardInfo, ...], directory: Path) -> ShardCache:
    return ShardCache(RemoteStore(f"file://{source}"), shards, directory, BUDGET_SHARDS * SHARD_BYTES)


def fetch_randomly(source: Path, shards: tuple[ShardInfo, ...], directory: Path, seed: int) -> None:
    cache = open_cache(source, shards, directory)
    rng = random.Random(seed)
    for _ in range(150):
        cache.fetch(rng.randrange(SHARDS))


def test_processes_fetching_at_once_never_hold_more_than_the_budget(tmp_path: Path) -> None:
    source, directory = tmp_path / "remote", tmp_path / "cache"
    shards = write_shards(source)
    monitor = open_cache(source, shards, directory)
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=fetch_randomly, args=(source, shards, directory, seed)) for seed in range(6)]
    for process in processes:
        process.start()
    counts = []
    while any(process.is_alive() for process in processes):
        with monitor.directory_lock():
            counts.append(monitor.used_bytes()[0])
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert max(counts) <= BUDGET_SHARDS * SHARD_BYTES, f"{max(counts) // SHARD_BYTES} shards held"
    cached = sorted(directory.glob("*.tar"))
    assert 0 < len(cached) <= BUDGET_SHARDS
    for path in cached:  # every shard that is there is whole and verified
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.stem
    assert not list(directory.glob(".*.tmp"))


def test_a_shard_download_is_one_request_with_its_size_taken_from_the_index(tmp_path: Path) -> None:
    source = tmp_path / "remote"
    shards = write_shards(source)
    cache = open_cache(source, shards, tmp_path / "cache")
    assert cache.fetch(5)
    assert cache.store.stats.requests == 1  # no size request, no parts
    assert cache.local_path(5).read_bytes() == (source / "5.tar").read_bytes()


def test_a_file_larger_than_one_get_comes_in_ranged_parts_and_whole(tmp_path: Path) -> None:
    source = tmp_path / "remote"
    shards = write_shards(source)
    store = RemoteStore(f"file://{source}")
    received = bytearray()
    assert store.download("3.tar", received.extend, SHARD_BYTES, part=SHARD_BYTES // 3 + 1) == SHARD_BYTES
    assert store.stats.requests == 3
    assert bytes(received) == (source / "3.tar").read_bytes()
    assert shards[3].sha256 == hashlib.sha256(received).hexdigest()
