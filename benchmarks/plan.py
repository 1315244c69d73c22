"""Time the epoch plan for a large synthetic index: `python -m benchmarks.plan [--samples 10000000]`.

Prints seconds per plan for several world sizes; every rank computes the same plan. Then plans a
mixture whose huge source is subsampled (`--huge` samples, `--draws` of them per epoch, beside a
small source drawn at its own size) and prints the seconds and the peak memory (tracemalloc) of
one epoch's plan. Run it with `PYTHONPATH=<a checkout>/src` to measure another version.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Sequence

import numpy as np

from image_edit_data.sampling.sampler import BucketBatchSampler

try:
    from image_edit_data.sampling.mixture_draw import Mixture
except ImportError:  # a checkout before 0.2, measured for comparison
    from image_edit_data.sampling.mixture import Mixture  # type: ignore[no-redef]


def bucketed(ids: np.ndarray, buckets: int, seed: int) -> list[np.ndarray]:
    """`ids` spread at random over `buckets` buckets, each bucket's ids ascending."""
    bucket_of = np.random.default_rng(seed).integers(0, buckets, ids.shape[0])
    order = np.argsort(bucket_of, kind="stable")
    return np.split(ids[order], np.cumsum(np.bincount(bucket_of, minlength=buckets))[:-1])


def best_plan_seconds(sampler: BucketBatchSampler, repeats: int) -> tuple[float, int]:
    """The fastest of `repeats` plans (each of a new epoch, so the cached plan does not count), and its steps."""
    best, steps = float("inf"), 0
    for repeat in range(repeats):
        sampler.set_epoch(repeat + 1)
        start = time.perf_counter()
        steps = len(sampler)
        best = min(best, time.perf_counter() - start)
    return best, steps


def plan_peak_bytes(sampler: BucketBatchSampler, epoch: int) -> int:
    """Peak memory allocated while planning `epoch` (the index itself was allocated before)."""
    sampler.set_epoch(epoch)
    tracemalloc.start()
    try:
        len(sampler)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bench_mixture(huge: int, draws: int, small: int, buckets: int, batch_sizes: Sequence[int], repeats: int) -> None:
    members = [
        np.concatenate(parts)
        for parts in zip(
            bucketed(np.arange(huge, dtype=np.int32), buckets, 1),
            bucketed(np.arange(huge, huge + small, dtype=np.int32), buckets, 2),
        )
    ]
    mixture = Mixture(
        (huge, small), (draws / (draws + small), small / (draws + small)), samples_per_epoch=draws + small
    )
    assert mixture.quotas() == [draws, small]
    sampler = BucketBatchSampler(bucket_members=members, batch_sizes=batch_sizes, world_size=8, mixture=mixture)
    seconds, steps = best_plan_seconds(sampler, repeats)
    peak = plan_peak_bytes(sampler, repeats + 1)
    print(
        f"mixture: {huge:,} samples drawn {draws:,} per epoch + {small:,} drawn once, {buckets} buckets, world 8: "
        f"{steps:,} steps, plan {seconds:.3f} s, peak {peak / 2**20:.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--buckets", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--huge", type=int, default=50_000_000, help="samples of the mixture's subsampled source")
    parser.add_argument("--draws", type=int, default=100_000, help="its draws per epoch")
    parser.add_argument("--small", type=int, default=100_000, help="samples of the source drawn at its own size")
    parser.add_argument("--skip-single", action="store_true", help="bench the mixture only")
    parser.add_argument("--exact-up-to", type=int, help="permute strata up to this size exactly (default: 16384)")
    args = parser.parse_args()
    if args.exact_up_to is not None:
        from image_edit_data.sampling import keyed_shuffle

        keyed_shuffle.EXACT_UP_TO = args.exact_up_to
    batch_sizes = [args.batch_size] * args.buckets
    if not args.skip_single:
        members = bucketed(np.arange(args.samples), args.buckets, 0)
        for world in (1, 8, 64):
            sampler = BucketBatchSampler(bucket_members=members, batch_sizes=batch_sizes, rank=0, world_size=world)
            seconds, steps = best_plan_seconds(sampler, args.repeats)
            line = f"{args.samples:,} samples, {args.buckets} buckets, world {world}: {steps:,} steps"
            print(f"{line}, plan {seconds:.3f} s")
    bench_mixture(args.huge, args.draws, args.small, args.buckets, batch_sizes, args.repeats)


if __name__ == "__main__":
    main()
