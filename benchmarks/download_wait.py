"""Whether a `shard_cache` reader should wait for a download of its shard already under way, or read by range.

Usage: python -m benchmarks.download_wait [--samples 400] [--shard-mib 32] [--rounds 3] [--batch-size 4]

Writes a synthetic cache of the `small` preset (about 0.9 MB per sample), packs it into moto's S3
server on 127.0.0.1 in shards of `--shard-mib`, and reads cold epochs in `shard_cache` mode (0
workers, `shard_window=1`, a fresh local cache each time), alternating two readers round by round:

- `wait`: a batch waits for the downloads of its shards under way (once per download, at most
  `download_wait` in all), as the loader does;
- `range`: a batch never waits and reads every member of a shard not cached yet by range.

Prints per reader the median over rounds of the epoch's seconds, the first batch's seconds, the MB
fetched by range and the MB downloaded whole, and the batches that waited.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from support.local_s3 import make_bucket, moto_server

from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.bench.synthetic import synthetic_spec, write_synthetic_cache
from image_edit_data.preprocess.tools.pack import pack_cache

MB = 1e6


def cold_epoch(url: str, options: dict[str, Any], local: Path, batch_size: int, wait: bool) -> dict[str, float]:
    """One cold epoch's numbers for a reader that waits for downloads under way, or one that reads by range."""
    config = ImageEditDataloaderConfig(
        url,
        num_workers=0,
        storage_options=options,
        remote_read="shard_cache",
        local_cache_dir=str(local),
        shard_window=1,
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
    reader: Any = built.dataloader.dataset.reader
    if not wait:
        reader.cached_files.wait = 0.0
    started = time.perf_counter()
    first = None
    try:
        for _ in built.dataloader:
            first = first if first is not None else time.perf_counter() - started
        elapsed = time.perf_counter() - started
    finally:
        built.dataloader.close()
    downloaded = reader.shard_cache.downloaded_bytes
    return {
        "epoch s": elapsed,
        "first batch s": first or 0.0,
        "MB by range": (reader.store.stats.bytes_fetched - downloaded) / MB,
        "MB downloaded": downloaded / MB,
        "batches that waited": reader.cached_files.waits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--shard-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"wait": [], "range": []}
    with tempfile.TemporaryDirectory(prefix="download-wait-") as scratch, moto_server() as options:
        root = Path(scratch)
        make_bucket(options, "bucket")
        spec = synthetic_spec("small", None, None, 1, "safetensors")
        files = write_synthetic_cache(root / "files", args.samples, spec)
        pack_cache(files, "s3://bucket/packed", args.shard_mib << 20, options, staging_dir=str(root / "staging"))
        for number in range(args.rounds):
            for name in ("wait", "range") if number % 2 == 0 else ("range", "wait"):
                local = root / f"local-{name}-{number}"
                results[name].append(cold_epoch("s3://bucket/packed", options, local, args.batch_size, name == "wait"))
    setting = f"{args.samples} samples, shards of {args.shard_mib} MiB, batch {args.batch_size}, 0 workers"
    print(f"{setting}, medians of {args.rounds} cold epochs")
    for name, rows in results.items():
        medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        print(f"{name:6} " + "   ".join(f"{key} {value:.2f}" for key, value in medians.items()))


if __name__ == "__main__":
    main()
