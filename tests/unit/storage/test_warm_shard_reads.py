"""A warm shard cache is read like a local packed cache: each shard opened once per process, the plan scanned rarely."""

from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.caches import make_payload, write_cache
from support.packed_copies import sample_in_shard

from image_edit_data import ImageEditDataset
from image_edit_data.index.store import open_index
from image_edit_data.mixture_dataset import MixturePrefetcher
from image_edit_data.payload.payload import OpenPayload
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.storage.damaged import DamagedShards
from image_edit_data.storage.prefetch import ShardPrefetcher
from image_edit_data.storage.remote import RemoteStore, RequestPolicy
from image_edit_data.storage.remote_reader import RemotePackedReader
from image_edit_data.storage.shard_cache import ShardCache


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warm")
    payloads = [make_payload(i, target=(4, 8, 8), contexts=((4, 8, 8),), sequence=5) for i in range(12)]
    source = write_cache(root / "source", payloads, suffix=".safetensors")
    size = os.path.getsize(source / "samples/sample_00000000.safetensors")
    pack_cache(source, str(root / "packed"), shard_bytes=4 * (size + 1024))
    return root / "packed"


def warm_reader(packed: Path, directory: Path) -> RemotePackedReader:
    """The packed cache read as a remote one (a file:// store), every shard already in the node's shard cache."""
    index = open_index(packed, use_store=False)
    store = RemoteStore(f"file://{packed}")
    cache = ShardCache(store, index.shards, directory, 10 * sum(shard.nbytes for shard in index.shards))
    for number in range(len(index.shards)):
        assert cache.fetch(number)
    return RemotePackedReader(index, store, cache, DamagedShards(directory))


def read_all(reader: RemotePackedReader, samples: list[int]) -> list[torch.Tensor]:
    """Each sample's target latent, read through `open_many` in batches of three."""
    targets = []
    for start in range(0, len(samples), 3):
        for payload in reader.open_many(samples[start : start + 3]):
            assert isinstance(payload, OpenPayload)
            try:
                targets.append(payload.fields["target_latent"].materialize())
            finally:
                payload.close()
    return targets


def test_a_warm_shard_cache_opens_each_shard_once_per_process_and_reads_the_same_samples(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = warm_reader(packed, tmp_path / "cache")
    assert reader.shard_cache is not None
    opened: list[int] = []
    open_cached = ShardCache.open_cached

    def noting_open(self: ShardCache, number: int) -> tuple[int, os.stat_result] | None:
        opened.append(number)
        return open_cached(self, number)

    monkeypatch.setattr(ShardCache, "open_cached", noting_open)
    samples = list(range(len(reader.index))) * 2
    targets = read_all(reader, samples)
    local = ImageEditDataset(packed)
    assert all(torch.equal(t, local[i]["target_latent"]) for i, t in zip(samples, targets))
    assert sorted(opened) == list(range(len(reader.index.shards))) and reader.fallbacks == 0
    descriptors = [descriptor for _, descriptor in reader.cached_files.open_files.values()]
    assert not reader.cached_files.holders  # every payload gave its shard back
    assert not pickle.loads(pickle.dumps(reader)).cached_files.open_files  # a loader worker opens its own
    reader.close()
    for descriptor in descriptors:
        with pytest.raises(OSError):
            os.fstat(descriptor)


def test_a_kept_descriptor_of_an_evicted_shard_is_closed_when_another_shard_is_opened(
    packed: Path, tmp_path: Path
) -> None:
    reader = warm_reader(packed, tmp_path / "cache")
    assert reader.shard_cache is not None
    first, other = sample_in_shard(packed, 0), sample_in_shard(packed, 1)
    read_all(reader, [first])
    reader.shard_cache.local_path(0).unlink()  # evicted by another process: its disk is freed only once closed
    assert read_all(reader, [other])
    assert list(reader.cached_files.open_files) == [1]
    expected = ImageEditDataset(packed)[first]["target_latent"]
    assert torch.equal(read_all(reader, [first])[0], expected) and reader.fallbacks == 1  # now by a ranged read
    reader.close()


class Plan:
    """An epoch plan of `steps` steps of `size` samples each, in sample order."""

    def __init__(self, steps: int, size: int) -> None:
        self.steps, self.size = steps, size
        self.scans = 0

    def __len__(self) -> int:
        return self.steps

    def step_samples(self, steps: slice) -> np.ndarray:
        self.scans += 1
        start, stop, _ = steps.indices(self.steps)
        return np.arange(start * self.size, stop * self.size)


class Sampler:
    """What the prefetcher needs of the sampler: one plan, from step 0."""

    segment_start = 0

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return len(self._plan)

    def plan(self) -> Any:
        return self._plan


def test_the_prefetcher_scans_the_plan_a_few_times_per_window_and_its_pins_cover_every_batch_around_it(
    packed: Path, tmp_path: Path
) -> None:
    index = open_index(packed, use_store=False)
    store = RemoteStore(f"file://{packed}")
    largest = max(shard.nbytes for shard in index.shards)
    cache = ShardCache(store, index.shards, tmp_path / "cache", largest)  # pins only the window: no room beyond
    for shard in index.shards:  # every shard already on the node: nothing to download, nothing finishes
        shutil.copyfile(packed / shard.path, tmp_path / "cache" / f"{shard.sha256}.tar")
    steps, size, ahead, behind = 64, 2, 8, 2
    member_shard = np.repeat(np.arange(len(index.shards)), -(-steps * size // len(index.shards)))[: steps * size]
    prefetcher = ShardPrefetcher(cache, member_shard, ahead=ahead, behind=behind)
    plan = Plan(steps, size)
    sampler = Sampler(plan)
    try:
        for step in range(steps):
            prefetcher(sampler, step)
            window = member_shard[max(0, step - behind) * size : min(steps, step + ahead + 1) * size]
            assert set(window.tolist()) <= cache.pinned(), step
        assert plan.scans <= steps // 2  # once per step or more would be a scan of the plan per batch
    finally:
        prefetcher.close()


def test_a_mixture_sources_prefetcher_also_scans_the_plan_a_few_times_per_window(packed: Path, tmp_path: Path) -> None:
    index = open_index(packed, use_store=False)
    largest = max(shard.nbytes for shard in index.shards)
    cache = ShardCache(RemoteStore(f"file://{packed}"), index.shards, tmp_path / "cache", largest)
    for shard in index.shards:
        shutil.copyfile(packed / shard.path, tmp_path / "cache" / f"{shard.sha256}.tar")
    steps, size = 64, 2
    member_shard = np.arange(steps * size) * len(index.shards) // (steps * size)
    mixture = MixturePrefetcher([(0, steps * size, ShardPrefetcher(cache, member_shard, ahead=8, behind=2))])
    plan = Plan(steps, size)
    try:
        for step in range(steps):
            mixture(Sampler(plan), step)
        assert plan.scans <= steps // 2
    finally:
        mixture.close()


def test_a_batch_waits_once_within_the_deadline_for_downloads_under_way_then_reads_by_range(
    packed: Path, tmp_path: Path
) -> None:
    """Two of a batch's shards are being downloaded (by another process, say) and never finish: the batch waits
    for them once, at most `download_wait` in all, reads their members by range, and never waits for them again."""
    index = open_index(packed, use_store=False)
    policy = RequestPolicy(deadline=0.6)
    store = RemoteStore(f"file://{packed}", retry=policy)
    directory = tmp_path / "cache"
    cache = ShardCache(store, index.shards, directory, 10 * sum(shard.nbytes for shard in index.shards))
    reader = RemotePackedReader(index, store, cache, DamagedShards(directory))
    batch = [sample_in_shard(packed, number, skip) for number in (0, 1) for skip in (0, 1)]
    for number in (0, 1):  # downloads under way by a live process (this one), which never end
        (directory / f".{index.shards[number].sha256}.{os.getpid()}.{number}.tmp").write_bytes(b"")
    expected = targets_of(warm_reader(packed, tmp_path / "warm").open_many(batch))
    for round in range(2):
        started = time.monotonic()
        assert all(torch.equal(a, b) for a, b in zip(targets_of(reader.open_many(batch)), expected))
        elapsed = time.monotonic() - started
        if round == 0:  # one wait for both downloads, not one per sample or per shard
            assert policy.download_wait <= elapsed < 2 * policy.download_wait, elapsed
        else:  # the same downloads: not waited for again
            assert elapsed < policy.download_wait / 2, elapsed
    assert reader.cached_files.waits == 1 and reader.fallbacks == 8


def targets_of(opened: list[Any]) -> list[torch.Tensor]:
    """The target latents of a batch's opened payloads (closed after)."""
    targets = []
    for payload in opened:
        assert isinstance(payload, OpenPayload)
        with payload:
            targets.append(payload.fields["target_latent"].materialize())
    return targets
