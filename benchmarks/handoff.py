"""CPU time per batch in the training process and in the workers: `python -m benchmarks.handoff CACHE`.

Shows what handing batches from workers to the training process costs on this machine: our
loader on CACHE at each worker count, then torch's own hand-off alone (a StatefulDataLoader over
a dataset that returns an empty batch). The workers' time is split between their main threads,
which load the batches, and their other threads (the result queue's feeder thread). Linux only
(reads the workers' CPU time from /proc).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable
from typing import Any

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.bench.measure import read_proc, worker_pids


class EmptyBatches(Dataset):
    """Batches holding only their sample indices: what is left is the DataLoader's own cost."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        return {"metadata": {"sample_indices": list(indices)}}


def workers_cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """CPU seconds (user + system) of the worker processes `pids`: their main threads, their other threads."""
    ticks = os.sysconf("SC_CLK_TCK")
    main_threads = other_threads = 0.0
    for pid in pids:
        for thread in os.listdir(f"/proc/{pid}/task"):
            text = read_proc(f"/proc/{pid}/task/{thread}/stat")
            if text is None:  # the thread has ended
                continue
            fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            seconds = (int(fields[11]) + int(fields[12])) / ticks
            if thread == str(pid):
                main_threads += seconds
            else:
                other_threads += seconds
    return main_threads, other_threads


def per_batch(label: str, loader: Iterable[Any], count: int, warmup: int = 10) -> None:
    """Print wall time and CPU time per batch (training process, workers) over `count` batches."""
    batches = iter(loader)
    for _ in range(warmup):
        next(batches)
    pids = worker_pids(batches, loader)
    workers_before, main_before, start = workers_cpu_seconds(pids), time.process_time(), time.perf_counter()
    for _ in range(count):
        next(batches)
    wall = time.perf_counter() - start
    main = time.process_time() - main_before
    workers_after = workers_cpu_seconds(pids)
    worker_main, worker_other = (after - before for after, before in zip(workers_after, workers_before))
    print(
        f"{label:<40} wall {wall / count * 1e3:5.2f} ms  training process {main / count * 1e3:5.2f} ms  "
        f"workers {(worker_main + worker_other) / count * 1e3:5.2f} ms (main threads "
        f"{worker_main / count * 1e3:5.2f}, other threads {worker_other / count * 1e3:5.2f})  per batch"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cache")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    for workers in args.num_workers:
        config = ImageEditDataloaderConfig(cache_dir=args.cache, num_workers=workers)
        build = {"dp_rank": 0, "dp_world_size": 1, "batch_size": args.batch_size}
        warm = iter(config.build(**build).dataloader)  # the same batches once first: read from the page cache
        for _ in range(args.batches + 10):
            next(warm)
        del warm
        per_batch(f"ours, {workers} workers", config.build(**build).dataloader, args.batches)
    for workers in [w for w in args.num_workers if w > 0]:
        plan = [list(range(i * args.batch_size, (i + 1) * args.batch_size)) for i in range(args.batches + 20)]
        empty = StatefulDataLoader(
            EmptyBatches(), batch_sampler=plan, collate_fn=lambda batch: batch, num_workers=workers
        )
        per_batch(f"torch's hand-off alone, {workers} workers", empty, args.batches)


if __name__ == "__main__":
    main()
