"""Worker memory over one whole epoch: `image-edit-data bench --worker-memory-index N`.

Forked workers share the parent's index until they write to it; a Python object per sample gets
written (reference counts, the garbage collector's marks) as the epoch touches it, so each worker
slowly copies the index. The cache here has N records whose payloads are hard links to one tiny
file, so an epoch over N records needs neither N payloads' bytes nor their time to write.

Each epoch runs in a process forked from a fork server (an interpreter that has only imported
this module), which builds the loader and forks its workers: a worker also turns private every
page of free heap it inherits and reuses, so forking from the bench itself (which has just written
and parsed N records) would charge each loader for the bench's garbage.
"""

from __future__ import annotations

import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dataloader_config import ImageEditDataloaderConfig
from .measure import LOADER_NOISE, Step, load_average, private_bytes, shut_down, worker_memory, worker_pids

if TYPE_CHECKING:
    from .other import OtherLoader

CHECKS = 20  # private memory samples per epoch, for the highest value


def _epoch_worker_memory(
    loader: str, num_workers: int, dataloader: Any, batches: int, batch_size: int, warmup: int
) -> dict[str, Any]:
    """Draw one epoch of `batches` from `dataloader`; worker private memory after `warmup` batches and at the end."""
    iterator = iter(dataloader)
    for _ in range(warmup):
        next(iterator)
    pids = worker_pids(iterator, dataloader)
    start = [private_bytes(pid) for pid in pids]
    highest = list(start)
    every = max(1, (batches - warmup) // CHECKS)
    load = load_average()
    began = time.perf_counter()
    for step in range(batches - warmup):
        next(iterator)
        if step % every == 0:
            highest = [larger(h, private_bytes(pid)) for h, pid in zip(highest, pids)]
    seconds = time.perf_counter() - began
    end = [private_bytes(pid) for pid in pids]  # before the iterator ends, which stops the workers
    del iterator
    shut_down(dataloader)
    workers = worker_memory(pids, start, end)
    for worker, high in zip(workers, highest):
        worker["uss_max_bytes"] = larger(high, worker["uss_end_bytes"])
    return {
        "loader": loader,
        "num_workers": num_workers,
        "batches": batches - warmup,
        "samples": (batches - warmup) * batch_size,
        "seconds": seconds,
        "samples_s": (batches - warmup) * batch_size / seconds,
        "load_average_1m": load,
        "workers": workers,
    }


def larger(a: int | None, b: int | None) -> int | None:
    """The larger of two readings, either of which may be missing."""
    return max((x for x in (a, b) if x is not None), default=None)


def _epoch_in_child(
    other: OtherLoader | None, cache_dir: str, workers: int, batch_size: int, prefetch_factor: int, warmup: int
) -> dict[str, Any]:
    """Build our loader, or `other`, and run `_epoch_worker_memory`."""
    # This process came from the fork server, whose start method it inherits; loaders fork their workers.
    multiprocessing.set_start_method("fork", force=True)
    warnings.filterwarnings("ignore", message=LOADER_NOISE)  # the bench's own filter does not reach this process
    if other is not None:
        build: Any = other.build(cache_dir, workers, prefetch_factor, batch_size)
    else:
        config = ImageEditDataloaderConfig(cache_dir, num_workers=workers, prefetch_factor=prefetch_factor)
        build = config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
    name = "ours" if other is None else other.name
    return _epoch_worker_memory(name, workers, build.dataloader, len(build.sampler), batch_size, warmup)


def run_epochs(
    cache_dir: Path,
    num_workers: tuple[int, ...],
    batch_size: int,
    prefetch_factor: int,
    warmup: int,
    other: OtherLoader | None,
    step: Step,
) -> list[dict[str, Any]]:
    """An epoch of ours, then of the other loader, at each worker count, each in a process of its own."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    results = []
    for workers in num_workers:
        for loader in [None, *([other] if other is not None else [])]:
            what = "our loader" if loader is None else f"the {loader.name} loader"
            with (
                step(f"one epoch of {what} with {workers} workers"),
                ProcessPoolExecutor(1, mp_context=context) as pool,
            ):
                args = (str(cache_dir), workers, batch_size, prefetch_factor, warmup)
                results.append(pool.submit(_epoch_in_child, loader, *args).result())
    return results
