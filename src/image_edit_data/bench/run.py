"""The three kinds of `image-edit-data bench` run: loaders on a cache, its index only, worker memory over an epoch."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console

from ..dataloader_config import ImageEditDataloaderConfig
from ..dataset import ImageEditDataset
from ..index.index import CacheIndex
from ..index.store import open_index
from ..mixture_dataset import MixtureDataset
from ..payload.payload import format_of
from .index_opens import measure_index_opens
from .measure import (
    Run,
    Step,
    load_average,
    machine_info,
    memcpy_bandwidth,
    page_cache_read_rate,
    timed_batches,
    wait_for_quiet,
    warm_page_cache,
)
from .naive import bare_loop, naive_loader
from .other import OtherLoader
from .workers import run_epochs

RESULTS_VERSION = 3  # 3: "reference" keys became "other" (any loader given to bench_main)


@dataclass(frozen=True)
class BenchOptions:
    """How each measurement is driven."""

    batch_size: int = 4
    num_workers: tuple[int, ...] = (0,)
    batches: int = 200
    warmup: int = 10
    rounds: int = 1
    prefetch_factor: int = 2
    compare_naive: bool = False
    memcpy_mib: int = 256
    wait_load: float | None = None
    torch_threads: int | None = None
    no_checksums: bool = False  # ours reads packed members unchecked: to measure what checking costs

    def check(self) -> None:
        """Refuse values no run could use."""
        for name, value, lowest in (
            ("--batch-size", self.batch_size, 1),
            ("--batches", self.batches, 1),
            ("--warmup", self.warmup, 0),
            ("--rounds", self.rounds, 1),
            ("--prefetch-factor", self.prefetch_factor, 1),
            ("--memcpy-mib", self.memcpy_mib, 1),
            ("--torch-threads", 1 if self.torch_threads is None else self.torch_threads, 1),
            *(("--num-workers", w, 0) for w in self.num_workers),
        ):
            if value < lowest:
                raise ValueError(f"{name}: expected an integer >= {lowest}, got {value}")
        if self.wait_load is not None and self.wait_load <= 0:
            raise ValueError(f"--wait-load: expected a positive load average, got {self.wait_load}")


def _stepper(console: Console, max_load: float | None) -> Step:
    """Each measurement's `with step(...)`: wait until the load average is below `max_load`, show what runs."""

    @contextlib.contextmanager
    def step(what: str) -> Iterator[None]:
        load = load_average()
        if max_load is not None and load is not None and load >= max_load:
            with console.status(f"{what}: waiting for the 1-minute load average ({load:.2f}) to fall below {max_load}"):
                wait_for_quiet(max_load)
        with console.status(what):
            yield

    return step


def _results_frame(mode: str, options: BenchOptions, other: OtherLoader | None) -> dict[str, Any]:
    """The keys every run kind reports; each fills in its own."""
    return {
        "version": RESULTS_VERSION,
        "mode": mode,
        "machine": machine_info(),
        "settings": {**asdict(options), "num_workers": list(options.num_workers)},
        "other": None if other is None else {"name": other.name, **other.about()},
        "cache": {},
        "index": [],
        "memcpy": None,
        "page_cache": None,
        "runs": [],
        "epochs": [],
    }


def _cache_facts(index: CacheIndex) -> dict[str, Any]:
    """What the report says about the cache."""
    return {"path": str(index.root), "samples": len(index), "buckets": len(index.signatures)}


def run_index_only(
    cache_dir: Path, options: BenchOptions, console: Console, other: OtherLoader | None = None
) -> dict[str, Any]:
    """Open times and memory of the index: ours parsing, ours from the store, the other loader's."""
    results = _results_frame("index", options, other)
    results["index"] = measure_index_opens(cache_dir, other, _stepper(console, options.wait_load))
    results["cache"] = _cache_facts(open_index(cache_dir))
    results["machine"]["load_average_1m_end"] = load_average()
    return results


def run_worker_memory(
    cache_dir: Path, options: BenchOptions, console: Console, other: OtherLoader | None = None
) -> dict[str, Any]:
    """Worker private memory over one whole epoch of ours and the other loader."""
    results = _results_frame("worker-memory", options, other)
    results["cache"] = _cache_facts(open_index(cache_dir))
    step = _stepper(console, options.wait_load)
    results["epochs"] = run_epochs(
        cache_dir, options.num_workers, options.batch_size, options.prefetch_factor, options.warmup, other, step
    )
    results["machine"]["load_average_1m_end"] = load_average()
    return results


def _check_warmup(cache_dir: Path, options: BenchOptions, other: OtherLoader | None) -> None:
    """Before anything is measured, refuse a --warmup of a whole epoch or more, or a comparison a packed cache lacks.

    What this opens is freed again.
    """
    config = _loader_config(cache_dir, options, num_workers=0)
    dataset = config.open_dataset()
    packed = isinstance(dataset, ImageEditDataset) and dataset.index.packed
    batches = len(config.build_for(dataset=dataset, **build_args(options)).sampler)
    del dataset
    gc.collect()  # the index opened here is gone before the index-open children fork
    file_readers = (["--compare-naive"] if options.compare_naive else []) + ([other.name] if other else [])
    if packed and file_readers:
        raise ValueError(
            f"{cache_dir}: a packed cache, which {' and '.join(file_readers)} cannot read (one file per sample): "
            "bench the cache it was packed from for those"
        )
    if batches <= options.warmup:
        raise ValueError(
            f"{cache_dir}: one epoch has {batches} batches of {options.batch_size}, "
            f"not more than --warmup {options.warmup}; lower --warmup or --batch-size"
        )


Measure = tuple[tuple[str, int | None], str, Callable[[], Run]]  # (loader, workers), what it times, timing


def run_loaders(
    cache_dir: Path, options: BenchOptions, console: Console, other: OtherLoader | None = None
) -> dict[str, Any]:
    """Index opens, memcpy, then every loader on the same cache (see `command.py`)."""
    results = _results_frame("loaders", options, other)
    step = _stepper(console, options.wait_load)
    _check_warmup(cache_dir, options, other)
    results["index"] = measure_index_opens(cache_dir, other, step)  # first: children fork from a small process
    with step("measuring memcpy bandwidth"):
        memcpy = results["memcpy"] = memcpy_bandwidth(options.memcpy_mib << 20)
    index = open_index(cache_dir)
    sampler = _loader_config(cache_dir, options, num_workers=0).build(**build_args(options)).sampler
    # Ours, the plain DataLoader and the bare loop read these batches: our first epoch, cut to warmup + batches.
    plan = [sampler.batch_for(s).tolist() for s in range(min(len(sampler), options.warmup + options.batches))]
    paths, sizes, planned = payload_files(index, {i for batch in plan for i in batch})
    with step("measuring the page-cache read rate"):
        warm_page_cache(planned)
        results["page_cache"] = page_cache_read_rate(planned)

    def ours(workers: int) -> Run:
        warm_page_cache(planned)
        config = _loader_config(cache_dir, options, workers)
        dataset = config.open_dataset()
        if options.no_checksums:
            unchecked(dataset)
        loader = config.build_for(dataset=dataset, **build_args(options)).dataloader
        return timed_batches("ours", workers, loader, plan, options.warmup, sizes, sample_indices)

    def naive(workers: int) -> Run:
        warm_page_cache(planned)
        loader = naive_loader(paths, plan, workers, options.prefetch_factor)
        return timed_batches("naive", workers, loader, plan, options.warmup, sizes)

    def bare() -> Run:
        warm_page_cache(planned)
        return bare_loop(paths, plan, options.warmup, sizes)

    measures: list[Measure] = [
        (("ours", w), f"our loader with {w} workers", partial(ours, w)) for w in options.num_workers
    ]
    if options.compare_naive:
        measures += [
            (("naive", w), f"a plain DataLoader with {w} workers", partial(naive, w)) for w in options.num_workers
        ]
        measures.append((("bare", None), "a bare load loop", bare))
    with contextlib.ExitStack() as stack:
        if other is not None:
            measures += stack.enter_context(other.measures(index, options, len(plan), step))
        runs = _fastest_rounds(measures, options.rounds, step)
    results["runs"] = _with_ratios(runs, memcpy["mb_s"], None if other is None else other.name)
    results["cache"] = {
        **_cache_facts(index),
        "epoch_batches": len(sampler),
        "formats": ["safetensors (packed)"] if index.packed else sorted({format_of(paths[i]) for i in sizes}),
        "mean_payload_bytes": sum(sizes.values()) / len(sizes),
        "member_checksums": None
        if not index.packed
        else index.member_checksum is not None and not options.no_checksums,
    }
    results["settings"]["measured_batches"] = len(plan) - options.warmup
    results["machine"]["load_average_1m_end"] = load_average()
    return results


def _fastest_rounds(measures: list[Measure], rounds: int, step: Step) -> dict[tuple[str, int | None], Run]:
    """Each measure `rounds` times, taking turns so that a slow spell of the machine hits all alike; the fastest."""
    runs: dict[tuple[str, int | None], Run] = {}
    for round_ in range(rounds):
        for key, what, measure in measures:
            with step(f"timing {what}" + (f" (round {round_ + 1} of {rounds})" if rounds > 1 else "")):
                run = measure()
            runs[key] = run if key not in runs else runs[key].faster(run)
    return runs


def _with_ratios(
    runs: dict[tuple[str, int | None], Run], memcpy_mb_s: float, other: str | None
) -> list[dict[str, Any]]:
    """Every run's numbers; ours also as ratios over the others at the same worker count (`other`: its name)."""
    rows = []
    for (loader, workers), run in runs.items():
        numbers = run.to_json(memcpy_mb_s)
        if loader == "ours":
            for name, base in (
                ("naive", runs.get(("naive", workers))),
                ("bare", runs.get(("bare", None))),
                ("other", None if other is None else runs.get((other, workers))),
            ):
                numbers[f"ours_over_{name}"] = None if base is None else ratio(numbers, base.to_json(memcpy_mb_s))
        rows.append(numbers)
    return rows


def payload_files(index: CacheIndex, samples: set[int]) -> tuple[list[str], dict[int, int], list[str]]:
    """Every sample's payload path, the planned samples' payload sizes, and the files they are read from.

    A packed cache's payloads are members of shards: their sizes are the members' and the files the shards.
    """
    paths = [str(index.root / index.relative_path(i)) for i in range(len(index))]
    if not index.packed:
        sizes = {i: Path(paths[i]).stat().st_size for i in sorted(samples)}
        return paths, sizes, [paths[i] for i in sizes]
    sizes = {i: index.member(i)[2] for i in sorted(samples)}
    shards = sorted({index.member(i)[0] for i in samples})
    return paths, sizes, [str(index.root / index.shards[number].path) for number in shards]


def unchecked(dataset: ImageEditDataset | MixtureDataset) -> None:
    """Make `dataset` read its packed members without their checksums: for measuring what checking costs only."""
    for source in dataset.sources if isinstance(dataset, MixtureDataset) else [dataset]:
        index = dataclasses.replace(source.index, member_checksum=None)
        source.index = source.reader.index = index


def sample_indices(batch: dict[str, Any]) -> list[int]:
    """The samples one of our batches holds."""
    return list(batch["metadata"]["sample_indices"])


def build_args(options: BenchOptions) -> dict[str, Any]:
    """The runtime facts our `build()` takes: one rank."""
    return {"dp_rank": 0, "dp_world_size": 1, "batch_size": options.batch_size}


def _loader_config(cache_dir: Path, options: BenchOptions, num_workers: int) -> ImageEditDataloaderConfig:
    """Our loader as a training run would configure it, at `num_workers`."""
    return ImageEditDataloaderConfig(
        cache_dir=str(cache_dir), num_workers=num_workers, prefetch_factor=options.prefetch_factor
    )


def ratio(ours: dict[str, Any], other: dict[str, Any]) -> float:
    """Our samples/s over another loader's."""
    return float(ours["samples_s"] / other["samples_s"])
