"""Claim: on the failure path a remote cache is exact too: deadlines, one retry budget, no false corruption.

A proxy on 127.0.0.1 stands in front of the test S3 endpoint and injects the faults real endpoints
have: 503s, 500s, connections reset or ended halfway through a body, and silence. Transient faults
are retried and the epoch equals a local read sample for sample, nothing skipped; an object that
always fails is tried exactly the budget's number of times and named; a silent endpoint is an error
naming the endpoint and the object within the deadline, with 0 workers and with 2, in both read modes.
The deadlines are short here; the defaults' bound is checked by arithmetic.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from support.fault_proxy import FAULTS, FaultProxy, fault_proxy, silent_endpoint

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset, RemoteError, RequestPolicy

SHORT = {"connect_timeout": 0.5, "read_timeout": 1.0, "attempts": 3, "deadline": 2.5, "base_delay": 0.01}
# The longest a request may take under SHORT: its deadline, one more try started just before it, a pause.
SHORT_BOUND = SHORT["deadline"] + SHORT["connect_timeout"] + SHORT["read_timeout"] + 1.0
FAST_RETRIES = {"attempts": 8, "base_delay": 0.01, "max_delay": 0.05, "deadline": 30.0}


@pytest.fixture
def proxy(s3: dict[str, Any]) -> Any:
    with fault_proxy(s3["endpoint_url"]) as running:
        yield running


def largest_shard_bytes(s3: dict[str, Any], url: str) -> int:
    """The size of the packed cache's largest shard, as the endpoint lists it."""
    import s3fs

    sizes = s3fs.S3FileSystem(skip_instance_cache=True, **s3).du(f"{url}/shards", total=False)
    assert len(sizes) > 6, sizes  # more shards than the budget below holds
    return max(sizes.values())


def through(s3: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The test endpoint's storage options, pointed at `endpoint` instead."""
    return {**s3, "endpoint_url": endpoint}


def epoch(cache: str | Path, workers: int, **options: Any) -> list[tuple[list[int], str]]:
    """One epoch's batches: sample indices and a digest of every tensor's bytes."""
    config = ImageEditDataloaderConfig(str(cache), num_workers=workers, prefetch_factor=1, worker_timeout=60, **options)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    try:
        out = []
        for batch in built.dataloader:
            digest = hashlib.sha256()
            for tensor in (batch["image_latents"], *batch["context_latents"], batch["text_embeddings"]):
                digest.update(tensor.contiguous().view(-1).view(dtype=tensor.dtype).numpy().tobytes())
            assert not batch["metadata"].get("skipped"), batch["metadata"]
            out.append((batch["metadata"]["sample_indices"], digest.hexdigest()))
        return out
    finally:
        built.dataloader.close()


def test_the_default_deadlines_end_a_request_to_a_silent_endpoint_within_120_seconds() -> None:
    policy = RequestPolicy()
    # The last try starts before the deadline and ends at its own connect + read deadlines; a reader
    # of the shard cache first waits for another's download at most DOWNLOAD_WAIT (or the deadline).
    worst = policy.download_wait + policy.deadline + policy.try_timeout + policy.max_delay
    assert worst <= 120, worst
    assert policy.attempts >= 3, "a transient fault gets retried more than once"


def test_opening_a_cache_on_a_silent_endpoint_fails_within_the_deadline_naming_endpoint_and_object(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    with silent_endpoint() as endpoint:
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            ImageEditDataset(
                packed_url,
                storage_options=through(s3, endpoint),
                local_cache_dir=str(tmp_path),
                remote_requests=SHORT,
            )
        elapsed = time.monotonic() - started
    assert elapsed < SHORT_BOUND, elapsed
    assert f"endpoint {endpoint}" in str(raised.value) and f"{packed_url}/" in str(raised.value)


@pytest.mark.slow  # waits out a (short) deadline in each of four runs
@pytest.mark.parametrize("mode", ["range", "shard_cache"])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_endpoint_that_falls_silent_mid_epoch_is_an_error_within_the_deadline(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path, workers: int, mode: str
) -> None:
    options = {"storage_options": through(s3, proxy.endpoint), "remote_read": mode, "remote_requests": SHORT}
    # A budget of three shards: the shard cache cannot have fetched the whole epoch before the fault.
    options["shard_cache_bytes"] = 3 * largest_shard_bytes(s3, packed_url)
    config = ImageEditDataloaderConfig(
        packed_url, num_workers=workers, prefetch_factor=1, worker_timeout=60, local_cache_dir=str(tmp_path), **options
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    batches = iter(built.dataloader)
    try:
        next(batches)
        proxy.fault = lambda number, method, path: "silent"  # a partition: connections open, no answer
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            for _ in batches:
                pass
        elapsed = time.monotonic() - started
    finally:
        built.dataloader.close()  # its workers, stuck or not, and its prefetcher end here
    # Two batches in flight with workers, each at most one request's bound, plus start-up slack.
    assert elapsed < 2 * SHORT_BOUND + 5, elapsed
    assert f"endpoint {proxy.endpoint}" in str(raised.value) and "/shards/" in str(raised.value)
    assert proxy.requests, "the loader read through the proxy"


def test_an_object_that_always_fails_is_tried_as_often_as_the_budget_says_then_named(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    dataset = ImageEditDataset(
        packed_url,
        storage_options=through(s3, proxy.endpoint),
        local_cache_dir=str(tmp_path),
        remote_requests={**SHORT, "deadline": 60.0},  # the count is the claim here, not the time
        on_corrupt_sample="skip",
    )
    proxy.fault = lambda number, method, path: "503" if "/shards/" in path else None
    shard = dataset.index.shards[dataset.index.member(0)[0]].path
    before = sum(proxy.requests.values())
    with pytest.raises(RemoteError, match=rf"{packed_url}/{shard}: .* failed after 3 attempts .*endpoint"):
        dataset[0]
    # One budget, not one per layer: botocore's and s3fs's own retries are off.
    assert sum(proxy.requests.values()) - before == SHORT["attempts"]
    assert not dataset.skips.skipped, "a failing endpoint is not a corrupt sample"


@pytest.mark.parametrize("mode", ["range", "shard_cache"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_flaky_endpoint_is_retried_and_the_epoch_equals_a_local_read(
    s3: dict[str, Any],
    source: Path,
    packed_url: str,
    proxy: FaultProxy,
    tmp_path: Path,
    workers: int,
    mode: str,
) -> None:
    proxy.fault = lambda number, method, path: FAULTS[(number // 3) % len(FAULTS)] if number % 3 == 2 else None
    remote = epoch(
        packed_url,
        workers,
        storage_options=through(s3, proxy.endpoint),
        remote_read=mode,
        local_cache_dir=str(tmp_path),
        remote_requests=FAST_RETRIES,
        on_corrupt_sample="skip",
    )
    assert remote == epoch(source, 0)
    assert sum(proxy.faults.values()) >= 4, proxy.faults
    if workers == 0 and mode == "range":
        assert set(proxy.faults) == set(FAULTS), proxy.faults  # each kind met and survived
