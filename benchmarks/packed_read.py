"""Samples/s of the loader over a local cache, alone: the packed read path without the remote layouts.

Usage: python -m benchmarks.packed_read CACHE [--num-workers 0 2] [--batches 99] [--repeat 3] [--json OUT]

Per worker count: builds the loader (batch size 4, default shuffle), draws one warm-up batch, then
times the next `--batches` batches; repeats that `--repeat` times and prints the fastest and the
median samples/s. Run it under two checkouts, alternating (`PYTHONPATH=.../src`), to compare a
change to the read path against its parent in one sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from image_edit_data.dataloader_config import ImageEditDataloaderConfig


def rate(cache: str, workers: int, batches: int) -> float:
    """Samples/s over `batches` batches after the first one."""
    config = ImageEditDataloaderConfig(cache, num_workers=workers, prefetch_factor=2)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=4)
    iterator = iter(built.dataloader)
    next(iterator)
    samples = 0
    start = time.perf_counter()
    for _, batch in zip(range(batches), iterator):
        samples += int(batch["metadata"]["batch_size"])
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batches", type=int, default=99)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for workers in args.num_workers:
        rates = [rate(args.cache, workers, args.batches) for _ in range(args.repeat)]
        results[workers] = {"best": max(rates), "median": statistics.median(rates), "rates": rates}
        print(f"workers {workers}: best {max(rates):.1f}, median {statistics.median(rates):.1f} samples/s")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(results, stream)


if __name__ == "__main__":
    main()
