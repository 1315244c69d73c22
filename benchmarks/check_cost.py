"""What a packed member's checksum costs per sample, split into the hash and everything around it.

Usage: python -m benchmarks.check_cost PACKED_CACHE [--batches 250] [--rounds 8] [--threads 1]

Reads the same shuffled batches of 4 through `ImageEditDataset.__getitems__` three ways, in
rotated order every round, and prints the median CPU µs per sample of each:

- `checked`: as every packed read runs;
- `no hash`: checked, with `MemberCheck.digest` answering the recorded checksum without hashing
  (everything the check does but the hash: measurement only, never a way to read);
- `unchecked`: the index's checksums dropped (`bench.run.unchecked`).

With `--threads 1` (the default) each batch is filled by the calling thread alone, as a loader
worker fills it, and CPU time is the thread's; with 2, batches of 1 MiB or more use the fill's
helper thread, as the training process does at 0 workers. Then it times, on one member's bytes just
read with `preadv`, XXH3 alone and the other fast checksums that are installed (CRC-32 from
python-isal or zlib-ng, CRC-32C from crc32c): the floor under the check.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from image_edit_data.batch import fill
from image_edit_data.bench.run import unchecked
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.payload.member_check import MemberCheck

Digest = Callable[[MemberCheck, Any], int]


def answer_recorded(check: MemberCheck, placed: Any) -> int:
    """A stand-in for `MemberCheck.digest` that skips the hash: the cost of the rest of the check."""
    return check.expected


def cpu_us_per_sample(dataset: ImageEditDataset, batches: list[list[int]], clock: Callable[[], float]) -> float:
    """CPU µs per sample to assemble `batches` (each batch dropped before the next, so its memory is reused)."""
    start = clock()
    for batch in batches:
        assembled = dataset.__getitems__(batch)
        del assembled
    return (clock() - start) / sum(len(batch) for batch in batches) * 1e6


def compare(cache: str, batches: int, rounds: int, threads: int) -> dict[str, float]:
    """Median CPU µs per sample of the three ways, over `rounds` rotated rounds."""
    if threads == 1:
        fill.PARALLEL_READ_MIN_BYTES = 1 << 62  # no helper thread: every row on the calling thread
    clock = time.thread_time if threads == 1 else time.process_time
    checked, plain = ImageEditDataset(cache), ImageEditDataset(cache)
    unchecked(plain)
    if checked.index.member_checksum is None:
        raise SystemExit(f"{cache}: this cache has no member checksums (pack it again with `cache pack`)")
    draw = random.Random(0)
    plan = [draw.sample(range(len(checked)), 4) for _ in range(batches)]
    real_digest = MemberCheck.digest
    ways: dict[str, tuple[ImageEditDataset, Digest]] = {
        "checked": (checked, real_digest),
        "no hash": (checked, answer_recorded),
        "unchecked": (plain, real_digest),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    try:
        for turn in range(rounds + 1):  # the first round warms the page cache and is dropped
            for name in names[turn % 3 :] + names[: turn % 3]:
                dataset, digest = ways[name]
                MemberCheck.digest = digest  # type: ignore[method-assign,assignment]
                taken = cpu_us_per_sample(dataset, plan, clock)
                if turn:
                    times[name].append(taken)
    finally:
        MemberCheck.digest = real_digest  # type: ignore[method-assign]
        checked.close()
        plain.close()
    return {name: statistics.median(values) for name, values in times.items()}


def member_bytes(cache: str) -> int:
    """The median length of the cache's packed members."""
    dataset = ImageEditDataset(cache)
    try:
        return int(statistics.median(dataset.index.member(i)[2] for i in range(len(dataset))))
    finally:
        dataset.close()


def checksum_functions() -> dict[str, Callable[[memoryview], object]]:
    """XXH3-64 and whichever other fast checksums of a buffer are installed."""
    found: dict[str, Callable[[memoryview], object]] = {"xxh3_64 (xxhash)": xxhash.xxh3_64_intdigest}
    for label, module, function in (
        ("crc32 (python-isal)", "isal.isal_zlib", "crc32"),
        ("crc32 (zlib-ng)", "zlib_ng.zlib_ng", "crc32"),
        ("crc32c (crc32c)", "crc32c", "crc32c"),
    ):
        try:
            found[label] = getattr(importlib.import_module(module), function)
        except ImportError:
            print(f"{label}: not installed")
    return found


def time_checksums(cache: str, nbytes: int, repeats: int = 300) -> None:
    """Print each checksum's µs over `nbytes` just read from the cache's first shard with `preadv`."""
    dataset = ImageEditDataset(cache)
    shard = os.path.join(cache, dataset.index.shards[0].path)
    dataset.close()
    descriptor = os.open(shard, os.O_RDONLY)
    try:
        span = max(1, os.fstat(descriptor).st_size - nbytes)
        target = memoryview(np.empty(nbytes, dtype=np.uint8))  # type: ignore[arg-type]
        draw = random.Random(1)
        for label, function in checksum_functions().items():
            taken = []
            for _ in range(repeats):
                os.preadv(descriptor, [target], draw.randrange(span))
                start = time.perf_counter()
                function(target)
                taken.append(time.perf_counter() - start)
            median = statistics.median(taken)
            print(f"{label}: {median * 1e6:.1f} µs per {nbytes / 1e6:.2f} MB ({nbytes / median / 1e9:.0f} GB/s)")
    finally:
        os.close(descriptor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache")
    parser.add_argument("--batches", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, choices=(1, 2), default=1)
    args = parser.parse_args()
    costs = compare(args.cache, args.batches, args.rounds, args.threads)
    base = costs["unchecked"]
    for name, cost in costs.items():
        print(f"{name}: {cost:.1f} CPU µs per sample ({cost / base:.3f} of unchecked)")
    print(
        f"the check costs {costs['checked'] - base:.1f} µs per sample: the hash and what it displaces "
        f"{costs['checked'] - costs['no hash']:.1f}, the rest {costs['no hash'] - base:.1f}"
    )
    time_checksums(args.cache, member_bytes(args.cache))


if __name__ == "__main__":
    main()
