"""Claim: on the failure path a remote cache is exact too: bounded in wall-clock time, one retry budget, no false
corruption.

A proxy on 127.0.0.1 stands in front of the test S3 endpoint and injects the faults real endpoints
have: error answers, connections reset or ended halfway through a body, silence before the answer
or in the middle of a body, a body that trickles, a byte flipped in flight. Transient faults are
retried and the epoch equals a local read sample for sample, nothing skipped; answers that retrying
cannot change are not retried; an object that always fails is tried exactly the budget's number of
times and named; a silent endpoint is an error naming the endpoint and the object within
`RequestPolicy.read_bound`, and each term of that bound is shown to be needed (a read whose
endpoint misbehaves takes longer than the bound without that term). The deadlines are short here;
`benchmarks/silent_endpoint.py` measures the bound at the defaults.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fault_proxy import FAULTS, Fault, FaultProxy, Seen, fault_proxy, silent_endpoint

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset, RemoteError, RequestPolicy
from image_edit_data.storage.remote import RemoteStore

SHORT = {"connect_timeout": 0.5, "read_timeout": 1.0, "attempts": 3, "deadline": 2.5, "base_delay": 0.01}
FAST_RETRIES = {"attempts": 8, "base_delay": 0.01, "max_delay": 0.05, "deadline": 30.0}
SLACK = 0.5  # seconds of scheduling beyond a bound that a loaded 2-core machine may add


@pytest.fixture
def proxy(s3: dict[str, Any]) -> Iterator[FaultProxy]:
    with fault_proxy(s3["endpoint_url"], stall_after=512) as running:
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


def two_in_shard(dataset: ImageEditDataset, number: int) -> list[int]:
    """Two samples whose members lie in shard `number`."""
    return [i for i in range(len(dataset)) if dataset.index.member(i)[0] == number][:2]


def timed_failure(read: Callable[[], object]) -> tuple[float, RemoteError]:
    """Seconds until `read()` raised its `RemoteError`, and the error."""
    started = time.monotonic()
    with pytest.raises(RemoteError) as raised:
        read()
    return time.monotonic() - started, raised.value


@pytest.mark.slow  # waits out a (short) deadline
def test_opening_a_cache_on_a_silent_endpoint_fails_within_the_bound_naming_endpoint_and_object(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    policy = RequestPolicy(**SHORT)  # type: ignore[arg-type]
    with silent_endpoint() as endpoint:
        elapsed, error = timed_failure(
            lambda: ImageEditDataset(
                packed_url, storage_options=through(s3, endpoint), local_cache_dir=str(tmp_path), remote_requests=SHORT
            )
        )
    assert policy.deadline < elapsed <= policy.request_bound(0) + SLACK, elapsed
    assert f"endpoint {endpoint}" in str(error) and f"{packed_url}/" in str(error)


def in_range_mode(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path, fault: Fault, **policy: float
) -> tuple[float, RemoteError, int]:
    """Read a batch by range, every ranged GET getting `fault`: seconds until the error, the error, the member size."""
    dataset = ImageEditDataset(
        packed_url,
        storage_options=through(s3, proxy.endpoint),
        local_cache_dir=str(tmp_path),
        remote_requests={**SHORT, **policy},
    )
    batch = two_in_shard(dataset, 2)
    proxy.fault = lambda seen: fault if seen.ranged else None
    elapsed, error = timed_failure(lambda: dataset.__getitems__(batch))
    return elapsed, error, max(dataset.index.member(i)[2] for i in batch)


@pytest.mark.slow  # waits out a (short) deadline
def test_a_read_from_an_endpoint_silent_before_its_answer_ends_after_the_deadline_and_a_try_within_the_bound(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    elapsed, error, length = in_range_mode(s3, packed_url, proxy, tmp_path, "silent")
    policy = RequestPolicy(**SHORT)  # type: ignore[arg-type]
    bound = policy.read_bound(length)
    # Tries start until the deadline, and the last one ends at its read timeout: both terms are spent.
    assert bound - policy.try_timeout < elapsed <= bound + SLACK, (elapsed, bound)
    assert f"endpoint {proxy.endpoint}" in str(error) and "/shards/" in str(error)


@pytest.mark.slow  # waits out a (short) deadline
def test_a_read_whose_body_trickles_ends_after_its_transfer_allowance_within_the_bound(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A body sent a byte at a time is never silent for a read timeout: only the transfer allowance ends the try."""
    # A ~2.9 KB member is allowed about 2 s on top of its timeouts, longer than the whole (shortened) deadline.
    short = {"deadline": 1.0, "min_transfer_rate": 1400.0}
    elapsed, error, length = in_range_mode(s3, packed_url, proxy, tmp_path, "trickle", **short)
    policy = RequestPolicy(**{**SHORT, **short})  # type: ignore[arg-type]
    bound = policy.read_bound(length)
    assert policy.transfer_allowance(length) > 1.5
    assert bound - policy.transfer_allowance(length) < elapsed <= bound + SLACK, (elapsed, bound)
    assert f"endpoint {proxy.endpoint}" in str(error) and "TimeoutError" in str(error)


@pytest.mark.slow  # waits out a (short) deadline
def test_a_read_waiting_on_a_download_that_falls_silent_mid_body_ends_after_its_wait_within_the_bound(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """The shard's download (the prefetcher's, or another process's) sends its first bytes and falls silent; the
    batch waits for it once, within the deadline, then reads by range from the same silent endpoint."""
    short = {**SHORT, "deadline": 1.2}  # the wait is the deadline's, here shorter than the default's 30 s
    dataset = ImageEditDataset(
        packed_url,
        storage_options=through(s3, proxy.endpoint),
        local_cache_dir=str(tmp_path),
        remote_read="shard_cache",
        shard_cache_bytes=10 * 10240,
        remote_requests=short,
    )
    cache = dataset.reader.shard_cache
    assert cache is not None
    batch = two_in_shard(dataset, 2)
    proxy.fault = lambda seen: "silent" if seen.ranged else "stall" if "/shards/" in seen.path else None
    outcome: list[BaseException] = []

    def fetch() -> None:
        try:
            cache.fetch(2)
        except RemoteError as error:
            outcome.append(error)

    download = threading.Thread(target=fetch, daemon=True)
    download.start()
    while not cache.downloads({2}):  # under way: its temporary file is there
        time.sleep(0.01)
    elapsed, error = timed_failure(lambda: dataset.__getitems__(batch))
    policy = RequestPolicy(**short)  # type: ignore[arg-type]
    bound = policy.read_bound(max(dataset.index.member(i)[2] for i in batch), waits=True)
    assert bound - policy.download_wait < elapsed <= bound + SLACK, (elapsed, bound)
    assert dataset.reader.cached_files.waits == 1  # type: ignore[attr-defined]
    assert f"endpoint {proxy.endpoint}" in str(error) and "/shards/" in str(error)
    download.join(timeout=policy.request_bound(cache.shards[2].nbytes) + SLACK)
    assert not download.is_alive() and outcome  # the download failed on its own, naming the shard
    assert not list(cache.directory.glob(".*.tmp"))  # no partial file left


@pytest.mark.slow  # waits out a (short) deadline
def test_a_download_that_falls_silent_mid_body_ends_at_its_read_timeout_not_its_transfer_allowance(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy
) -> None:
    """Silence ends a try after `read_timeout`, in obstore (the first try) as in s3fs: only a body still moving may
    use the transfer allowance, here 80 s for a shard of 8 KiB."""
    policy = RequestPolicy(**{**SHORT, "min_transfer_rate": 100.0})  # type: ignore[arg-type]
    store = RemoteStore(packed_url, through(s3, proxy.endpoint), policy)
    assert store.obstore_usable()
    proxy.fault = lambda seen: "stall" if "/shards/" in seen.path else None  # headers, 512 bytes, silence
    shard = "shards/b0000-000000.tar"
    elapsed, error = timed_failure(lambda: store.download(shard, lambda piece: None, 8192))
    assert elapsed <= policy.deadline + policy.try_timeout + SLACK < policy.transfer_allowance(8192), elapsed
    assert f"endpoint {proxy.endpoint}" in str(error) and shard in str(error)


@pytest.mark.slow  # waits out a (short) bound in each of four runs, two of them with worker processes
@pytest.mark.parametrize("mode", ["range", "shard_cache"])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_endpoint_that_falls_silent_mid_epoch_is_an_error_within_the_bound(
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
        # A partition: connections open, no answer; downloads under way stall after their first bytes.
        proxy.fault = lambda seen: "silent" if seen.ranged else "stall"
        elapsed, error = timed_failure(lambda: [None for _ in batches])
    finally:
        started = time.monotonic()
        built.dataloader.close()  # its workers, stuck or not, and its prefetcher end here
        closing = time.monotonic() - started
    index = built.dataloader.dataset.index
    largest = max(index.member(i)[2] for i in range(len(index)))
    bound = RequestPolicy(**SHORT).read_bound(largest, waits=mode == "shard_cache")  # type: ignore[arg-type]
    # A worker's error reaches the training process in a moment (one batch's fetch, one pickle).
    assert elapsed <= bound + SLACK + (1.0 if workers else 0.0), (elapsed, bound)
    assert f"endpoint {proxy.endpoint}" in str(error) and "/shards/" in str(error)
    assert closing < 1.0 + SLACK + (1.0 if workers else 0.0), closing  # stuck workers are ended, not waited for
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
    proxy.fault = lambda seen: "503" if "/shards/" in seen.path else None
    shard = dataset.index.shards[dataset.index.member(0)[0]].path
    before = sum(proxy.requests.values())
    with pytest.raises(RemoteError, match=rf"{packed_url}/{shard}: .* failed after 3 attempts .*endpoint"):
        dataset[0]
    # One budget, not one per layer: botocore's and s3fs's own retries are off.
    assert sum(proxy.requests.values()) - before == SHORT["attempts"]
    assert not dataset.skips.skipped, "a failing endpoint is not a corrupt sample"


@pytest.mark.parametrize(("fault", "tries"), [("400", 1), ("403", 1), ("408", 3), ("429", 3), ("500", 3)])
def test_answers_that_retrying_cannot_change_are_not_retried_and_the_others_are(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, fault: Fault, tries: int
) -> None:
    store = RemoteStore(packed_url, through(s3, proxy.endpoint), RequestPolicy(**{**SHORT, "deadline": 60.0}))  # type: ignore[arg-type]
    proxy.fault = lambda seen: fault if seen.ranged else None
    words = "refused .* not tried again" if tries == 1 else f"failed after {tries} attempts"
    with pytest.raises(RemoteError, match=rf"{packed_url}/shards/b0000-000000.tar: reading bytes .* {words}"):
        store.read_range("shards/b0000-000000.tar", 512, 100)
    assert proxy.faults[fault] == tries == store.stats.requests


def test_a_store_without_credentials_is_refused_at_once_without_a_request(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    keyless = {name: value for name, value in through(s3, proxy.endpoint).items() if name not in ("key", "secret")}
    for read in ("read_range", "download"):
        store = RemoteStore(packed_url, keyless, RequestPolicy(**{**SHORT, "deadline": 60.0}))  # type: ignore[arg-type]
        with pytest.raises(RemoteError, match=r"refused .* not tried again: .*[Cc]redentials"):
            if read == "read_range":
                store.read_range("shards/b0000-000000.tar", 512, 100)
            else:
                store.download("shards/b0000-000000.tar", lambda piece: None, 100)
        assert store.stats.requests == 1, read
    assert not proxy.requests  # nothing was sent: the request could not be signed


def test_a_shard_damaged_in_flight_once_is_downloaded_again_and_one_damaged_twice_is_condemned_naming_why(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    dataset = ImageEditDataset(
        packed_url,
        storage_options=through(s3, proxy.endpoint),
        local_cache_dir=str(tmp_path),
        remote_read="shard_cache",
        shard_cache_bytes=10 * 10240,
        remote_requests=FAST_RETRIES,
    )
    cache = dataset.reader.shard_cache
    assert cache is not None
    flipped: set[str] = set()

    def once(seen: Seen) -> Fault | None:
        if seen.ranged or "/shards/" not in seen.path or seen.path in flipped:
            return None
        flipped.add(seen.path)
        return "flip"

    proxy.fault = once
    shard = cache.shards[3]
    assert cache.fetch(3) and cache.local_path(3).exists()  # the second download's bytes matched
    assert proxy.requests[f"/bucket/packed/{shard.path}"] == 2 and not list(cache.directory.glob("*.damaged"))
    proxy.fault = lambda seen: "flip" if "/shards/" in seen.path and not seen.ranged else None
    shard = cache.shards[4]
    with pytest.raises(ValueError, match=rf"{packed_url}/{shard.path}: xxh3_128: shard hashes to .* on two downloads"):
        cache.fetch(4)
    assert proxy.requests[f"/bucket/packed/{shard.path}"] == 2
    assert cache.damaged.find(shard) is not None and not cache.fetch(4)  # condemned on the node, not fetched again


@pytest.mark.slow  # waits out a (short) deadline
def test_closing_a_prefetcher_returns_at_once_and_its_download_ends_on_its_own_leaving_no_file(
    s3: dict[str, Any], packed_url: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    config = ImageEditDataloaderConfig(
        packed_url,
        num_workers=0,
        storage_options=through(s3, proxy.endpoint),
        remote_read="shard_cache",
        local_cache_dir=str(tmp_path),
        shard_cache_bytes=10 * 10240,
        remote_requests=SHORT,
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    prefetcher = built.sampler.observer
    assert prefetcher is not None
    proxy.fault = lambda seen: "stall" if "/shards/" in seen.path and not seen.ranged else None
    next(iter(built.sampler))  # handing out step 0 starts the downloads, which stall mid-body
    cache = prefetcher.cache  # type: ignore[attr-defined]
    while not list(cache.directory.glob(".*.tmp")):
        time.sleep(0.01)
    started = time.monotonic()
    built.dataloader.close()
    assert time.monotonic() - started < 1.0
    assert not cache.pinned()
    deadline = time.monotonic() + RequestPolicy(**SHORT).request_bound(10240) + SLACK  # type: ignore[arg-type]
    while (list(cache.directory.glob(".*.tmp")) or prefetch_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(cache.directory.glob(".*.tmp")) and not prefetch_threads()


def prefetch_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("shard-prefetch")]


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
    proxy.fault = lambda seen: FAULTS[(seen.number // 3) % len(FAULTS)] if seen.number % 3 == 2 else None
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
