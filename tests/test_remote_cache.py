"""Caches in object storage: a real S3 endpoint (moto's server on 127.0.0.1) and injected faults.

One server serves the whole module. Packing writes to it; the loader reads it with 0 and 2
workers, by ranged requests and through the local shard cache; a DataModule fit killed after a
checkpoint resumes exactly from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import yaml
from cachefactory import tiny_cache
from fit_harness import FitOptions, SimulatedKill, fit
from fsspec.implementations.local import LocalFileSystem
from process_group import run_process_group
from s3server import make_bucket, moto_server

from image_edit_data.__main__ import main
from image_edit_data.cache.cli import cache_main
from image_edit_data.cache.pack import pack_cache
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.loader import ImageEditDataloaderConfig
from image_edit_data.storage.location import open_location
from image_edit_data.storage.remote import RemoteError, RemoteStore, RetryPolicy
from image_edit_data.storage.shard_cache import ShardCache


@pytest.fixture(scope="module")
def s3() -> Any:
    with moto_server() as options:
        make_bucket(options, "bucket")
        yield options


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("src"), counts=(7, 5, 4), suffix=".safetensors")


@pytest.fixture(scope="module")
def packed_url(s3: dict[str, Any], source: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The source packed straight into the bucket through the command line."""
    staging = tmp_path_factory.mktemp("staging")
    argv = ["pack", str(source), "s3://bucket/packed", "--shard-bytes", "8192"]
    assert cache_main([*argv, "--storage-options", json.dumps(s3), "--staging-dir", str(staging)]) == 0
    return "s3://bucket/packed"


def batches(cache: str | Path, workers: int, **options: Any) -> list[list[int]]:
    config = ImageEditDataloaderConfig(str(cache), num_workers=workers, prefetch_factor=1, **options)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    try:
        return [b["metadata"]["sample_indices"] for b in built.dataloader]
    finally:
        if built.sampler.observer is not None:
            built.sampler.observer.close()


def fs(options: dict[str, Any]) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **options)


def test_a_cache_packed_into_s3_validates_and_inspects_there(
    s3: dict[str, Any], packed_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cache_main(["validate", packed_url, "--storage-options", json.dumps(s3)]) == 0
    assert cache_main(["inspect", packed_url, "--storage-options", json.dumps(s3)]) == 0
    shown = capsys.readouterr().out
    assert "ok: 16 samples" in shown and "packed: 13 tar shard(s)" in shown
    with pytest.raises(ValueError, match="already holds a finished cache"):
        pack_cache("unused", packed_url, storage_options=s3)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["range", "shard_cache"])
def test_the_loader_reads_an_s3_packed_cache_like_the_local_source(
    s3: dict[str, Any], source: Path, packed_url: str, tmp_path: Path, workers: int, mode: str
) -> None:
    local = batches(source, workers)
    remote = batches(
        packed_url,
        workers,
        storage_options=s3,
        remote_read=mode,
        local_cache_dir=str(tmp_path),
        shard_cache_bytes=5 * 10240,
    )
    assert remote == local
    shards = list(tmp_path.glob("*/shards/*.tar"))
    assert (len(shards) > 0) == (mode == "shard_cache")
    assert sum(p.stat().st_size for p in shards) <= 5 * 10240
    assert not list(tmp_path.glob("*/shards/.*.tmp"))


def test_a_one_file_per_sample_cache_in_s3_reads_like_the_local_one(
    s3: dict[str, Any], source: Path, tmp_path: Path
) -> None:
    fs(s3).put(str(source), "bucket/files", recursive=True)
    remote = ImageEditDataset("s3://bucket/files", storage_options=s3, local_cache_dir=str(tmp_path))
    assert not remote.index.packed
    assert remote[5]["metadata"] == ImageEditDataset(source)[5]["metadata"]
    assert batches("s3://bucket/files", 0, storage_options=s3, local_cache_dir=str(tmp_path)) == batches(source, 0)


def copy_packed(s3: dict[str, Any], packed_url: str, name: str) -> str:
    fs(s3).copy(packed_url.removeprefix("s3://"), f"bucket/{name}", recursive=True)
    return f"s3://bucket/{name}"


def test_a_missing_shard_is_an_error_naming_its_url(s3: dict[str, Any], packed_url: str, tmp_path: Path) -> None:
    url = copy_packed(s3, packed_url, "missing")
    dataset = ImageEditDataset(url, storage_options=s3, local_cache_dir=str(tmp_path))
    shard = dataset.index.shards[0].path
    fs(s3).rm(f"bucket/missing/{shard}")
    victim = next(i for i in range(len(dataset)) if dataset.index.member(i)[0] == 0)
    with pytest.raises(FileNotFoundError, match=rf"{url}/{shard}: does not exist"):
        dataset[victim]


def test_a_truncated_or_replaced_shard_is_refused_and_leaves_nothing_in_the_local_cache(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    url = copy_packed(s3, packed_url, "damaged")
    index, reader = open_location(url, storage_options=s3, local_cache_dir=str(tmp_path))
    assert reader is not None and reader.store is not None
    first, second = index.shards[0], index.shards[1]
    data = fs(s3).cat_file(f"bucket/damaged/{first.path}")
    fs(s3).pipe_file(f"bucket/damaged/{first.path}", data[:700])  # cut inside the first member
    victim = next(i for i in range(len(index)) if index.member(i)[0] == 0)
    with pytest.raises(RemoteError, match=rf"{url}/{first.path}: reading bytes .* returned \d+ bytes"):
        reader.open(victim)
    tampered = bytearray(fs(s3).cat_file(f"bucket/damaged/{second.path}"))
    tampered[-100] ^= 1
    fs(s3).pipe_file(f"bucket/damaged/{second.path}", bytes(tampered))
    cache = ShardCache(reader.store, index.shards, tmp_path / "shards", 10 * 10240)
    with pytest.raises(ValueError, match=rf"{url}/{first.path}: bytes: shard is 700 bytes"):
        cache.fetch(0)
    with pytest.raises(ValueError, match=rf"{url}/{second.path}: sha256: shard hashes to"):
        cache.fetch(1)
    assert [p.name for p in (tmp_path / "shards").iterdir() if p.suffix != ".pin"] == [".lock"]


def test_a_budget_smaller_than_one_shard_is_refused(s3: dict[str, Any], packed_url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"shard_cache_bytes=4096 is smaller than shard s3://bucket/packed/shards/"):
        ImageEditDataset(
            packed_url,
            storage_options=s3,
            remote_read="shard_cache",
            shard_cache_bytes=4096,
            local_cache_dir=str(tmp_path),
        )


def test_eviction_never_removes_a_pinned_shard_and_orphaned_downloads_are_cleaned(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    index, reader = open_location(packed_url, storage_options=s3, local_cache_dir=str(tmp_path))
    assert reader is not None and reader.store is not None
    directory = tmp_path / "shards"
    directory.mkdir()
    orphan = directory / f".{index.shards[5].sha256}.999999999.1.tmp"  # a download by a process that is gone
    orphan.write_bytes(b"half")
    cache = ShardCache(reader.store, index.shards, directory, 2 * 10240)
    assert not orphan.exists()
    cache.pin({0, 1})
    assert cache.fetch(0) and cache.fetch(1)
    assert not cache.fetch(2)  # both cached shards are pinned: no room, nothing evicted
    assert cache.local_path(0).exists() and cache.local_path(1).exists()
    other = ShardCache(reader.store, index.shards, directory, 2 * 10240)  # another process on the node
    assert not other.fetch(2)
    cache.pin({1})
    assert other.fetch(2) and not cache.local_path(0).exists() and cache.local_path(1).exists()
    assert cache.high_water <= 2 * 10240 and other.high_water <= 2 * 10240


class FlakyFileSystem(LocalFileSystem):
    """A local filesystem whose ranged reads fail `failures` times before working (a flaky network)."""

    protocol = "flaky"
    calls = 0

    def __init__(self, failures: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failures = failures

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        FlakyFileSystem.calls += 1
        if start is not None and FlakyFileSystem.calls <= self.failures:
            raise ConnectionError("connection reset by peer")
        return bytes(super().cat_file(self._strip_protocol(path), start=start, end=end, **kwargs))

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        return super()._strip_protocol(path.removeprefix("flaky://"))


def test_transient_errors_are_retried_then_reported_with_the_url(packed_url: str, tmp_path: Path) -> None:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    packed = tmp_path / "packed"
    pack_cache(tiny_cache(tmp_path / "src", counts=(2,), suffix=".safetensors"), str(packed), shard_bytes=8192)
    fast = RetryPolicy(attempts=3, base_delay=0.01)
    FlakyFileSystem.calls = 0
    store = RemoteStore(f"flaky://{packed}", {"failures": 2}, retry=fast)
    assert len(store.read_range("shards/b0000-000000.tar", 512, 100)) == 100
    assert store.stats.requests == 3
    FlakyFileSystem.calls = 0
    store = RemoteStore(f"flaky://{packed}", {"failures": 5}, retry=fast)
    with pytest.raises(RemoteError, match=rf"flaky://{packed}/shards/b0000-000000.tar: .* failed after 3 attempts"):
        store.read_range("shards/b0000-000000.tar", 512, 100)


def test_a_remote_store_pickles_without_its_client_and_makes_a_new_one_per_process(s3: dict[str, Any]) -> None:
    import pickle

    store = RemoteStore("s3://bucket/packed", s3)
    client = store.fs
    copy = pickle.loads(pickle.dumps(store))
    assert copy._fs is None and copy.fs is not client
    store._pid = -1  # as if this were a forked child: the parent's client is not reused
    assert store.fs is not client


def records(out: Path) -> list[tuple[int, list[int]]]:
    return [(line["epoch"], line["ids"]) for line in map(json.loads, (out / "rank0.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("mode", ["range", "shard_cache"])
def test_a_fit_on_an_s3_cache_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path, mode: str
) -> None:
    common = dict(storage_options=json.dumps(s3), remote_read=mode, local_cache_dir=str(tmp_path / "local"))
    whole = FitOptions(packed_url, str(tmp_path / "whole"), epochs=2, in_process=True, **common)  # type: ignore[arg-type]
    fit(whole)
    broken = whole | {"out": str(tmp_path / "run"), "kill_at_step": 5}
    with pytest.raises(SimulatedKill):
        fit(broken)
    fit(broken | {"kill_at_step": None, "ckpt": str(tmp_path / "run" / "ckpt" / "step=5.ckpt")})
    assert records(tmp_path / "run") == records(tmp_path / "whole")


@pytest.mark.slow
def test_a_real_fit_with_workers_on_s3_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    harness = Path(__file__).with_name("fit_harness.py")
    common = ["--storage-options", json.dumps(s3), "--remote-read", "shard_cache", "--num-workers", "2"]
    common += ["--local-cache-dir", str(tmp_path / "local"), "--epochs", "2"]

    def run(out: str, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(harness), packed_url, str(tmp_path / out), *common, *extra]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        return run_process_group(command, timeout=300, env=env)

    # The data order does not depend on workers, so an in-process run gives the uninterrupted baseline.
    options = dict(storage_options=json.dumps(s3), remote_read="range", local_cache_dir=str(tmp_path / "local"))
    fit(FitOptions(packed_url, str(tmp_path / "whole"), epochs=2, in_process=True, **options))  # type: ignore[arg-type]
    killed = run("run", "--kill-at-step", "6")
    assert killed.returncode == 17, killed.stderr[-2000:]
    resumed = run("run", "--ckpt", str(tmp_path / "run" / "ckpt" / "step=6.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(tmp_path / "run") == records(tmp_path / "whole")


def test_the_prefetcher_downloads_the_shards_the_plan_reads_next_within_the_budget(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    config = ImageEditDataloaderConfig(
        packed_url,
        num_workers=0,
        storage_options=s3,
        remote_read="shard_cache",
        local_cache_dir=str(tmp_path),
        shard_cache_bytes=3 * 10240,
        shard_window=1,
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    sampler, prefetcher = built.sampler, built.sampler.observer
    assert prefetcher is not None
    first = next(iter(sampler))  # handing out step 0 starts the downloads
    prefetcher.wait()
    cache = prefetcher.cache
    shard_of = built.dataloader.dataset.index.member_shard
    assert all(cache.local_path(int(shard_of[i])).exists() for i in first)
    cached = list((cache.directory).glob("*.tar"))
    assert 1 <= len(cached) <= 3 and cache.high_water <= 3 * 10240
    prefetcher.close()


def test_a_shard_another_process_is_downloading_is_not_fetched_twice(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    index, reader = open_location(packed_url, storage_options=s3, local_cache_dir=str(tmp_path))
    assert reader is not None and reader.store is not None
    directory = tmp_path / "shards"
    cache = ShardCache(reader.store, index.shards, directory, 4 * 10240)
    busy = directory / f".{index.shards[3].sha256}.{os.getpid()}.7.tmp"  # a live process's download
    busy.write_bytes(b"")
    assert not cache.fetch(3) and not cache.local_path(3).exists()
    assert [p.name for p in directory.glob(".*.tmp")] == [busy.name]
    assert cache.open_when_cached(3, timeout=0.05) is None  # a reader waits a bounded time, then reads ranges
    busy.unlink()
    assert cache.fetch(3)
    opened = cache.open_when_cached(3, timeout=0.05)
    assert opened is not None
    os.close(opened[0])


def cli_config(path: Path, out: Path, url: str, s3: dict[str, Any], kill_at_step: int | None) -> Path:
    """A LightningCLI fit config: the recording model, 2 workers, the S3 packed cache through the shard cache."""
    checkpoint = {"kill_at_step": kill_at_step, "in_process": True, "dirpath": str(out / "ckpt"), "filename": "{step}"}
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 2,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(out),
            "callbacks": [
                {
                    "class_path": "fit_harness.KillAfterCheckpoint",
                    "init_args": {**checkpoint, "every_n_train_steps": 1, "save_top_k": -1},
                }
            ],
        },
        "model": {"class_path": "fit_harness.RecordingModel", "init_args": {"out": str(out)}},
        "data": {
            "cache_dir": url,
            "batch_size": 2,
            "num_workers": 2,
            "storage_options": s3,
            "remote_read": "shard_cache",
            "local_cache_dir": str(path.parent / "local"),
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_lightning_cli_fit_with_workers_on_s3_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    whole, run = tmp_path / "whole", tmp_path / "run"
    main(["fit", "--config", str(cli_config(tmp_path / "whole.yaml", whole, packed_url, s3, None))])
    killed = cli_config(tmp_path / "killed.yaml", run, packed_url, s3, 5)
    with pytest.raises(SimulatedKill):
        main(["fit", "--config", str(killed)])
    resumed = cli_config(tmp_path / "resumed.yaml", run, packed_url, s3, None)
    main(["fit", "--config", str(resumed), "--ckpt_path", str(run / "ckpt" / "step=5.ckpt")])
    assert len(records(run)) > 5 and records(run) == records(whole)
