"""Time the epoch plan for a large synthetic index: `python scripts/bench_plan.py [--samples 10000000]`.

Prints seconds per plan for several world sizes; every rank computes the same plan.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from image_edit_data.sampling.sampler import BucketBatchSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--buckets", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    bucket_of = np.random.default_rng(0).integers(0, args.buckets, args.samples)
    order = np.argsort(bucket_of, kind="stable")
    members = np.split(order, np.cumsum(np.bincount(bucket_of, minlength=args.buckets))[:-1])
    for world in (1, 8, 64):
        sampler = BucketBatchSampler(
            bucket_members=members, batch_sizes=[args.batch_size] * args.buckets, rank=0, world_size=world
        )
        best = float("inf")
        for repeat in range(args.repeats):
            sampler.set_epoch(repeat + 1)  # a new epoch: the cached plan does not count
            start = time.perf_counter()
            steps = len(sampler)
            best = min(best, time.perf_counter() - start)
        print(f"{args.samples:,} samples, {args.buckets} buckets, world {world}: {steps:,} steps, plan {best:.3f} s")


if __name__ == "__main__":
    main()
