"""How long a read takes to fail when its endpoint falls silent, at the default deadlines and shard size.

Usage: python -m benchmarks.silent_endpoint [--samples 300] [--batch-size 4] [--runs range:0:silent ...]

Writes a synthetic cache of the `small` preset (about 0.9 MB per sample), packs it into moto's S3
server on 127.0.0.1 with `cache pack`'s default shard size (256 MiB: downloads go in ranged parts of
64 MiB), and reads it through the fault proxy of the tests (`tests/support/fault_proxy.py`) with
the default `RequestPolicy`. Each run opens a fresh loader through a healthy proxy, then makes the
endpoint misbehave and times the first batch until its error:

- `silent`: no request gets an answer (connections open, nothing sent back: a partition);
- `stall` (`shard_cache` mode): every shard's download is under way when the batch is read (started
  as the prefetcher starts them); each gets its headers and 1 MiB of its part, then silence, and
  member reads get no answer. The batch first waits for its shards' downloads, as readers do.

Prints per run the seconds until the error, the documented bound (`RequestPolicy.read_bound` for the
batch's largest member, with the download wait in `shard_cache` mode), whether the error names the
endpoint and the object, and its first words. A run is `MODE:WORKERS:FAULT`; the default runs are
every read mode with 0 and 2 workers, and both faults in `shard_cache` mode.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path

from support.fault_proxy import Seen, fault_proxy
from support.local_s3 import make_bucket, moto_server

from image_edit_data import ImageEditDataloaderConfig, RemoteError
from image_edit_data.bench.synthetic import synthetic_spec, write_synthetic_cache
from image_edit_data.preprocess.tools.pack import DEFAULT_SHARD_BYTES, pack_cache
from image_edit_data.storage.remote import RequestPolicy
from image_edit_data.storage.shard_cache import ShardCache

RUNS = [
    "range:0:silent",
    "range:2:silent",
    "shard_cache:0:silent",
    "shard_cache:2:silent",
    "shard_cache:0:stall",
    "shard_cache:2:stall",
]
DOWNLOAD_PART = 8 << 20  # a ranged GET longer than this is a download's part, not a member read


def misbehave(fault: str) -> object:
    """The proxy's fault for each request once the endpoint misbehaves."""

    def choose(seen: Seen) -> str:
        download = "/shards/" in seen.path and (seen.length is None or seen.length > DOWNLOAD_PART)
        return "stall" if fault == "stall" and download else "silent"

    return choose


def start_downloads(cache: ShardCache | None) -> None:
    """Start every shard's download in the background, as the prefetcher does, and return once all are under way."""
    assert cache is not None, "downloads stall in shard_cache mode only"
    numbers = set(range(len(cache.shards)))
    for number in numbers:
        threading.Thread(target=fetch_quietly, args=(cache, number), daemon=True).start()
    while len(cache.downloads(numbers)) < len(numbers):
        time.sleep(0.01)


def fetch_quietly(cache: ShardCache, number: int) -> None:
    """A download whose failure is the run's point, not news."""
    with contextlib.suppress(RemoteError):
        cache.fetch(number)


def one_run(url: str, options: dict[str, object], run: str, batch_size: int, local: Path) -> str:
    """Time one run's first batch until its error; its report line."""
    mode, workers, fault = run.split(":")
    with fault_proxy(options["endpoint_url"]) as proxy:  # type: ignore[arg-type]
        config = ImageEditDataloaderConfig(
            url,
            num_workers=int(workers),
            storage_options={**options, "endpoint_url": proxy.endpoint},
            remote_read=mode,  # type: ignore[arg-type]
            local_cache_dir=str(local / run.replace(":", "-")),
            worker_timeout=600,
        )
        built = config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
        index = built.dataloader.dataset.index
        largest = max(index.member(i)[2] for i in range(len(index)))
        bound = RequestPolicy().read_bound(largest, waits=mode == "shard_cache")
        proxy.fault = misbehave(fault)  # type: ignore[assignment]
        if fault == "stall":
            start_downloads(built.dataloader.dataset.reader.shard_cache)
        started = time.monotonic()
        try:
            next(iter(built.dataloader))
            outcome, elapsed = "no error", time.monotonic() - started
        except RemoteError as error:
            elapsed = time.monotonic() - started
            text = str(error)
            named = f"endpoint {proxy.endpoint}" in text and "/shards/" in text
            # A worker's error comes wrapped by torch's loader: its own message is the traceback's last line.
            message = [line for line in text.splitlines() if line.strip()][-1].rpartition("RemoteError: ")[2]
            outcome = f"{'names endpoint and object' if named else 'NAMES NEITHER'}: {message[:70]}..."
        finally:
            built.dataloader.close()
    verdict = "within" if elapsed <= bound else "OVER"
    return f"{run:22} {elapsed:7.1f} s   bound {bound:6.1f} s   {verdict:6}  {outcome}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300, help="samples of the small preset (0.9 MB each)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--runs", nargs="+", default=RUNS, help="MODE:WORKERS:FAULT, e.g. shard_cache:2:stall")
    args = parser.parse_args()
    policy = RequestPolicy()
    print(
        f"RequestPolicy(): connect {policy.connect_timeout:g} s, read {policy.read_timeout:g} s, "
        f"{policy.attempts} attempts, deadline {policy.deadline:g} s, transfer allowance "
        f"{policy.min_transfer_rate / (1 << 20):g} MiB/s, download wait {policy.download_wait:g} s; "
        f"shards of {DEFAULT_SHARD_BYTES >> 20} MiB, batch {args.batch_size}"
    )
    with tempfile.TemporaryDirectory(prefix="silent-endpoint-") as scratch, moto_server() as options:
        root = Path(scratch)
        make_bucket(options, "bucket")
        spec = synthetic_spec("small", None, None, 1, "safetensors")
        files = write_synthetic_cache(root / "files", args.samples, spec)
        pack_cache(files, "s3://bucket/packed", storage_options=options, staging_dir=str(root / "staging"))
        for run in args.runs:
            print(one_run("s3://bucket/packed", options, run, args.batch_size, root / "local"), flush=True)


if __name__ == "__main__":
    main()
