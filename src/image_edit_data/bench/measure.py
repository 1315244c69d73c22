"""What `image-edit-data bench` measures: the machine, memcpy and page-cache read rates, worker memory, loading.

Memory and worker CPU figures come from `/proc` (Linux); elsewhere they are None. Throughput
counts the payload bytes of the samples a loader yielded, whatever it does with them. CPU per
sample counts this process (all its threads) and each loader worker, read while the workers are
alive: a pool that persists across epochs is never reaped, so the reaped-children totals of
`getrusage` would never see it, and a fork server's workers are not this process's children at all.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..batch.buffer import usable_cores

MB = 1e6  # throughput is in MB/s of 10^6 bytes
# Warnings said once per loader built, about the loaders and not the numbers: pin_memory without a GPU, set_vital.
LOADER_NOISE = ".*(pin_memory|set_vital).*"
# `with step("what is measured"):` around each measurement: waits for a quiet machine, shows progress.
Step = Callable[[str], AbstractContextManager[None]]


def read_proc(path: str) -> str | None:
    """Text of a `/proc` file, or None where there is none (not Linux, process gone)."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _proc_fields(text: str | None) -> dict[str, int]:
    """`Name:   123 kB` lines of a `/proc` file, in bytes."""
    fields: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024
    return fields


def rss_bytes() -> int | None:
    """Resident set size of this process."""
    return _proc_fields(read_proc("/proc/self/status")).get("VmRSS")


def private_bytes(pid: int) -> int | None:
    """Unique set size of process `pid`: its `Private_*` pages, which no other process shares."""
    fields = _proc_fields(read_proc(f"/proc/{pid}/smaps_rollup"))
    if not fields:
        return None
    return sum(fields.get(name, 0) for name in ("Private_Clean", "Private_Dirty", "Private_Hugetlb"))


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else whatever `platform` knows."""
    for line in (read_proc("/proc/cpuinfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """The facts a throughput number needs next to it."""
    usable = usable_cores()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": _proc_fields(read_proc("/proc/meminfo")).get("MemTotal"),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": load_average(),
    }


def load_average() -> float | None:
    """Runnable processes over the last minute: other work on the machine skews every rate."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def wait_for_quiet(max_load: float | None, timeout_s: float = 900.0, poll_s: float = 5.0) -> float | None:
    """Sleep until the 1-minute load average is below `max_load` (at most `timeout_s`); return the load then."""
    deadline = time.monotonic() + timeout_s
    load = load_average()
    while max_load is not None and load is not None and load >= max_load and time.monotonic() < deadline:
        time.sleep(poll_s)
        load = load_average()
    return load


def warm_page_cache(paths: Iterable[str | Path], chunk: int = 1 << 20) -> None:
    """Read each file once, so timed runs read from memory, not from whatever the disk does then.

    The kernel may have dropped pages of a cache written minutes ago (memory pressure, proactive
    reclaim); without this, whichever loader runs first would pay for the disk.
    """
    buffer = bytearray(chunk)
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def page_cache_read_rate(paths: Sequence[str], repeats: int = 3) -> dict[str, Any]:
    """MB/s of reading `paths` from the page cache with one `preadv` each into one reused buffer.

    Every loader that reads the files pays this kernel copy (ours does it straight into the
    batch), so it bounds them all; on some machines it runs well below memcpy.
    """
    sizes = [os.path.getsize(path) for path in paths]
    buffer = np.zeros(max(sizes, default=1), dtype=np.uint8)  # zeros: its pages are in place before timing
    view = memoryview(buffer)  # type: ignore[arg-type]  # numpy arrays are buffers

    def read_all() -> None:
        for path, size in zip(paths, sizes):
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.preadv(descriptor, [view[:size]], 0)
            finally:
                os.close(descriptor)

    return {"mb_s": _best_rate(read_all, sum(sizes), repeats), "files": len(paths), "repeats": repeats}


def _best_rate(copy: Any, nbytes: int, repeats: int) -> float:
    """Best MB/s of `repeats` calls of `copy()`, each moving `nbytes`."""
    copy()  # faults the destination's pages in, so no run pays for first touch
    best = min(timed(copy) for _ in range(repeats))
    return nbytes / best / MB


def timed(call: Any) -> float:
    """Seconds one call of `call()` takes."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Copy rate of this machine: numpy's copy (libc memcpy, one thread) and torch's (all its threads)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    single = _best_rate(lambda: np.copyto(target.numpy(), source.numpy()), nbytes, repeats)
    threaded = _best_rate(lambda: target.copy_(source), nbytes, repeats)
    return {
        "mb_s": max(single, threaded),  # the limit: the faster of the two ways to move bytes
        "single_thread_mb_s": single,
        "torch_mb_s": threaded,
        "torch_threads": torch.get_num_threads(),
        "buffer_bytes": nbytes,
        "repeats": repeats,
    }


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds process `pid` has used so far, all its threads (None: gone, or no /proc)."""
    text = read_proc(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> tuple[float, float | None]:
    """CPU seconds used so far by this process and by the worker processes `pids` together (None: unknown)."""
    workers = [process_cpu_seconds(pid) for pid in pids]
    known = None if any(w is None for w in workers) else sum(w for w in workers if w is not None)
    return time.process_time(), known


@dataclass
class Run:
    """One timed stretch of batches from one loader."""

    loader: str  # "ours", "naive" or "bare"
    num_workers: int | None  # None: no DataLoader at all
    batches: int
    samples: int
    payload_bytes: int
    seconds: float
    workers: list[dict[str, Any]] = field(default_factory=list)
    load_average_1m: float | None = None  # when the timed batches started
    round_seconds: tuple[float, ...] = ()  # every round's time, this run's among them (empty: one round)
    main_cpu_seconds: float | None = None  # this process, all threads, over the timed batches
    worker_cpu_seconds: float | None = None  # the loader's workers together, over the same batches

    def faster(self, other: Run) -> Run:
        """The faster of two rounds of the same batches, remembering both rounds' times."""
        rounds = (self.round_seconds or (self.seconds,)) + (other.round_seconds or (other.seconds,))
        return replace(other if other.seconds < self.seconds else self, round_seconds=rounds)

    def cpu_ms_per_sample(self) -> tuple[float | None, float | None]:
        """CPU milliseconds per sample of this process and of the workers (None: not measured)."""
        main = None if self.main_cpu_seconds is None else 1000 * self.main_cpu_seconds / self.samples
        workers = 0.0 if not self.num_workers else self.worker_cpu_seconds
        return main, None if workers is None else 1000 * workers / self.samples

    def to_json(self, memcpy_mb_s: float) -> dict[str, Any]:
        """The run's numbers, with rates and the fraction of the memcpy limit."""
        mb_s = self.payload_bytes / self.seconds / MB
        main_cpu, worker_cpu = self.cpu_ms_per_sample()
        return {
            "loader": self.loader,
            "num_workers": self.num_workers,
            "batches": self.batches,
            "samples": self.samples,
            "payload_bytes": self.payload_bytes,
            "seconds": self.seconds,
            "samples_s": self.samples / self.seconds,
            "mb_s": mb_s,
            "memcpy_fraction": mb_s / memcpy_mb_s,
            "workers": self.workers,
            "load_average_1m": self.load_average_1m,
            "rounds_samples_s": [self.samples / seconds for seconds in self.round_seconds or (self.seconds,)],
            "main_cpu_ms_per_sample": main_cpu,
            "worker_cpu_ms_per_sample": worker_cpu,
            "cpu_ms_per_sample": None if main_cpu is None or worker_cpu is None else main_cpu + worker_cpu,
        }


def worker_pids(iterator: object, loader: object) -> list[int]:
    """PIDs of a multi-process DataLoader's workers (none for an in-process one).

    Torch's iterator holds them; our loader's passes hand out batches through a generator, and its
    persistent pool's iterator stays on the loader.
    """
    holder = iterator if hasattr(iterator, "_workers") else getattr(loader, "_iterator", None)
    return [int(worker.pid) for worker in getattr(holder, "_workers", [])]


def shut_down(loader: object) -> None:
    """Stop the workers a DataLoader keeps between epochs (`persistent_workers`); others stop with their iterator."""
    if hasattr(loader, "close"):  # ours: its public way
        loader.close()
        return
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if iterator is not None:
        loader._iterator = None  # type: ignore[attr-defined]


def worker_memory(pids: Sequence[int], start: Sequence[int | None], end: Sequence[int | None]) -> list[dict[str, Any]]:
    """Per worker: private memory at the start and end of a stretch, and the growth."""
    return [
        {"pid": pid, "uss_start_bytes": a, "uss_end_bytes": b, "uss_growth_bytes": b - a if a and b else None}
        for pid, a, b in zip(pids, start, end)
    ]


def timed_batches(
    loader: str,
    num_workers: int,
    batches: Iterable[Any],
    plan: Sequence[Sequence[int]],
    warmup: int,
    sizes: Mapping[int, int],
    indices_of: Callable[[Any], list[int]] | None = None,
) -> Run:
    """Draw `plan`'s batches from `batches`; time all after the first `warmup`; sample worker memory.

    `indices_of(batch)`, when given, must name the planned samples: the last batch is checked.
    """
    iterator = iter(batches)
    for _ in range(warmup):
        next(iterator)
    pids = worker_pids(iterator, batches)
    before = [private_bytes(pid) for pid in pids]
    measured = plan[warmup:]
    load = load_average()
    main_start, workers_start = cpu_seconds(pids)
    start = time.perf_counter()
    for _ in measured:
        last = next(iterator)
    seconds = time.perf_counter() - start
    main_end, workers_end = cpu_seconds(pids)  # while the workers are alive, before the pool is shut down
    after = [private_bytes(pid) for pid in pids]
    del iterator  # shuts the workers down before the next run starts its own (unless they persist)
    shut_down(batches)
    if indices_of is not None and list(indices_of(last)) != list(measured[-1]):
        raise RuntimeError(f"{loader} loader yielded other samples than planned, so loaders would not be comparable")
    workers = worker_memory(pids, before, after)
    worker_cpu = None if workers_start is None or workers_end is None else workers_end - workers_start
    totals = plan_totals(measured, sizes)
    return Run(
        loader, num_workers, len(measured), *totals, seconds, workers, load, (), main_end - main_start, worker_cpu
    )


def plan_totals(batches: Sequence[Sequence[int]], sizes: Mapping[int, int]) -> tuple[int, int]:
    """Samples and payload bytes in `batches`."""
    return sum(len(b) for b in batches), sum(sizes[i] for b in batches for i in b)
