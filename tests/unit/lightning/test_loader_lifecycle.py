"""Claim: a loader's resources (worker pool, prefetch threads, shard pins) end with their owner.

A fit with `reload_dataloaders_every_n_epochs=1` asks the data module for a new training loader
every epoch; each replaced loader is closed, so after 20 rebuilds this process holds as many open
files, worker processes and shard pins as after the first, threads within the few that downloads in
flight come and go with, and none of the workers or pins once the fit has ended. Run on a local
cache and on a packed cache in S3 (moto on 127.0.0.1) read through the shard cache, whose
prefetcher has download threads and pins.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from support.caches import tiny_cache
from support.fits import RecordingModel
from support.processes import worker_processes

from image_edit_data import ImageEditDataModule
from image_edit_data.preprocess.cli import cache_main

pytestmark = pytest.mark.slow  # a worker pool per epoch

REBUILDS = 10  # enough that a thread left behind per loader (9 by the end) exceeds the download threads (5)
DOWNLOAD_THREADS = 5  # a prefetcher's pool (4) and one obstore request's helper


def descriptors() -> list[str]:
    """What each of this process's open file descriptors refers to."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            continue
    return targets


def resources(others: set[int]) -> dict[str, int]:
    """What this process holds besides the processes `others`; collected garbage first, so that only what
    something still holds counts.

    Cached shards the running loader reads are counted apart: it keeps one descriptor per shard it
    has read from the shard cache, so their number depends on which downloads finished before the
    reads (a shard not yet cached is read by range instead), not on earlier loaders.
    """
    gc.collect()
    open_files = descriptors()
    shard_files = sum(is_cached_shard(target) for target in open_files)
    return {
        "open files": len(open_files) - shard_files,
        "cached shards open": shard_files,
        "threads": len(os.listdir("/proc/self/task")),
        "worker processes": len(worker_processes() - others),
        "shard pins": sum(target.endswith(".pin") for target in open_files),  # the pins' lock files
    }


def is_cached_shard(target: str) -> bool:
    """Whether a descriptor's target is a shard in a node-local shard cache."""
    return target.endswith(".tar") and Path(target).parent.name == "shards"


class Counts(pl.Callback):
    """What the process holds at the last batch of every epoch (its loader's pool running)."""

    def __init__(self, others: set[int]) -> None:
        self.others = others
        self.by_epoch: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.by_epoch.append(resources(self.others))


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(4, 4), suffix=".safetensors")


# Workers on the local cache; the prefetcher (threads, pins) runs in this process, so none on S3.
@pytest.mark.slow  # ten loaders, one with a worker pool each time
@pytest.mark.parametrize(("where", "workers"), [("local", 2), ("s3 shard cache", 0)])
def test_ten_loader_rebuilds_hold_what_the_first_held_and_the_fit_leaves_no_workers_or_pins(
    where: str, workers: int, local_cache: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {"cache_dir": str(local_cache)}
    if where != "local":
        s3 = request.getfixturevalue("s3")
        argv = ["pack", str(local_cache), "s3://bucket/lifecycle", "--shard-bytes", "4096"]
        assert cache_main([*argv, "--storage-options", json.dumps(s3), "--staging-dir", str(tmp_path / "staging")]) == 0
        options = {
            "cache_dir": "s3://bucket/lifecycle",
            "storage_options": s3,
            "remote_read": "shard_cache",
            "local_cache_dir": str(tmp_path / "local"),
            "shard_cache_bytes": 4 * 4096,
        }
    data = ImageEditDataModule(batch_size=2, num_workers=workers, worker_timeout=60, **options)
    others = worker_processes()  # the S3 server
    before = resources(others)  # what earlier tests in this process left (a pin of a cache they did not close)
    counts = Counts(others)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=REBUILDS + 1,
        limit_train_batches=1,
        reload_dataloaders_every_n_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counts],
        default_root_dir=tmp_path,
    )
    trainer.fit(RecordingModel(str(tmp_path)), datamodule=data)
    first, last = counts.by_epoch[1], counts.by_epoch[REBUILDS]
    held_by_one_loader = max(c.pop("cached shards open") for c in counts.by_epoch)
    # Download threads come and go with the downloads in flight (the prefetch pool grows to its 4
    # threads on demand; an obstore request runs on a helper thread while it lasts), so the count
    # at a batch may differ by a few; one thread left behind per loader would add REBUILDS - 1 by the end.
    threads = [c.pop("threads") for c in counts.by_epoch[1:]]
    assert max(threads) - min(threads) <= DOWNLOAD_THREADS, f"threads from the first rebuild on: {threads}"
    assert last == first, f"after the first rebuild {first}, after {REBUILDS}: {last}"
    assert first["worker processes"] == workers
    if where != "local":
        assert first["shard pins"] > before["shard pins"]  # the prefetcher ran
        assert held_by_one_loader <= 4  # one loader's shards, at most the 4 the budget holds; none of earlier loaders
    after = resources(others)
    assert (after["worker processes"], after["shard pins"]) == (0, before["shard pins"])
    assert after["cached shards open"] == before["cached shards open"]  # the last loader's closed with it
