"""A batch of a remote cache, alone or in a mixture, is fetched with concurrent requests, not one after another."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support.caches import tiny_cache

from image_edit_data import CacheSource, ImageEditDataloaderConfig, ImageEditDataset
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.storage.remote import RemoteStore


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("src"), counts=(12, 8), suffix=".safetensors")


class InFlight:
    """Counts requests in flight; each request takes a while, as on a real link."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0

    def around(self, request: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.05)
                return request(*args, **kwargs)
            finally:
                with self.lock:
                    self.now -= 1

        return counted


@pytest.mark.parametrize("layout", ["packed", "files"])
def test_a_batch_of_a_remote_cache_is_fetched_with_concurrent_requests(
    s3: dict[str, Any], source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    if layout == "packed":
        url = f"s3://bucket/concurrent-{layout}"
        argv = ["pack", str(source), url, "--shard-bytes", "8192", "--staging-dir", str(tmp_path / "staging")]
        assert cache_main([*argv, "--storage-options", json.dumps(s3)]) == 0
    else:
        url = f"s3://bucket/concurrent-{layout}"
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3)
        fs.put(str(source), url.removeprefix("s3://"), recursive=True)
    flight = InFlight()
    reading = "read_range" if layout == "packed" else "fetch"
    monkeypatch.setattr(RemoteStore, reading, flight.around(getattr(RemoteStore, reading)))
    options = {"storage_options": s3, "local_cache_dir": str(tmp_path / "local")}
    built = ImageEditDataloaderConfig(url, num_workers=0, shuffle=False, **options).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    remote = [batch["metadata"]["sample_indices"] for batch in built.dataloader]
    local = ImageEditDataloaderConfig(str(source), num_workers=0, shuffle=False).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    assert remote == [batch["metadata"]["sample_indices"] for batch in local.dataloader]  # the same samples
    assert flight.most == 4  # each batch's four members were requested at once
    assert ImageEditDataset(url, **options)[3]["metadata"] == ImageEditDataset(source)[3]["metadata"]


def test_a_remote_source_of_a_mixture_fetches_its_share_of_a_batch_concurrently(
    s3: dict[str, Any], source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "s3://bucket/concurrent-mixture"
    argv = ["pack", str(source), url, "--shard-bytes", "8192", "--staging-dir", str(tmp_path / "staging")]
    assert cache_main([*argv, "--storage-options", json.dumps(s3)]) == 0
    flight = InFlight()
    monkeypatch.setattr(RemoteStore, "read_range", flight.around(RemoteStore.read_range))
    sources = [CacheSource(url, name="remote"), CacheSource(str(source), name="local")]
    options = {"storage_options": s3, "local_cache_dir": str(tmp_path / "local")}
    built = ImageEditDataloaderConfig(sources=sources, num_workers=0, **options).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    batches = list(built.dataloader)
    most_remote = max(batch["metadata"]["sources"].count("remote") for batch in batches)
    assert most_remote >= 2, "the plan must put several remote samples in one batch for this test to mean anything"
    assert flight.most == most_remote  # a batch's remote members were requested at once, not one by one
