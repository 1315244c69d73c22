"""The three kinds of `image-edit-data bench` run: loaders on a cache, its index only, worker memory over an epoch."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
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
from .reference import (
    build_reference,
    convert_payloads,
    reference_files,
    reference_plan,
    reference_version,
    write_pt_twin_index,
)
from .workers import run_epochs

RESULTS_VERSION = 2


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
    compare_reference: bool = False
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


def _results_frame(mode: str, options: BenchOptions, reference: ModuleType | None) -> dict[str, Any]:
    """The keys every run kind reports; each fills in its own."""
    return {
        "version": RESULTS_VERSION,
        "mode": mode,
        "machine": machine_info(),
        "settings": {**asdict(options), "num_workers": list(options.num_workers)},
        "reference": None if reference is None else {"module": reference.__name__, "version": reference_version()},
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
    cache_dir: Path, options: BenchOptions, console: Console, reference: ModuleType | None
) -> dict[str, Any]:
    """Open times and memory of the index: ours parsing, ours from the store, the reference."""
    results = _results_frame("index", options, reference)
    results["index"] = measure_index_opens(cache_dir, reference, _stepper(console, options.wait_load))
    results["cache"] = _cache_facts(open_index(cache_dir))
    results["machine"]["load_average_1m_end"] = load_average()
    return results


def run_worker_memory(
    cache_dir: Path, options: BenchOptions, console: Console, reference: ModuleType | None
) -> dict[str, Any]:
    """Worker private memory over one whole epoch of ours and the reference."""
    results = _results_frame("worker-memory", options, reference)
    results["cache"] = _cache_facts(open_index(cache_dir))
    step = _stepper(console, options.wait_load)
    results["epochs"] = run_epochs(
        cache_dir, options.num_workers, options.batch_size, options.prefetch_factor, options.warmup, reference, step
    )
    results["machine"]["load_average_1m_end"] = load_average()
    return results


def _check_warmup(cache_dir: Path, options: BenchOptions) -> None:
    """Before anything is measured, refuse a --warmup of a whole epoch or more, or a comparison a packed cache lacks.

    What this opens is freed again.
    """
    config = _loader_config(cache_dir, options, num_workers=0)
    dataset = config.open_dataset()
    packed = isinstance(dataset, ImageEditDataset) and dataset.index.packed
    batches = len(config.build_for(dataset=dataset, **build_args(options)).sampler)
    del dataset
    gc.collect()  # the index opened here is gone before the index-open children fork
    if packed and (options.compare_naive or options.compare_reference):
        raise ValueError(
            f"{cache_dir}: a packed cache; --compare-naive and --compare-reference read one file per sample: "
            "bench the cache it was packed from for those"
        )
    if batches <= options.warmup:
        raise ValueError(
            f"{cache_dir}: one epoch has {batches} batches of {options.batch_size}, "
            f"not more than --warmup {options.warmup}; lower --warmup or --batch-size"
        )


Measure = tuple[tuple[str, int | None], str, Callable[[], Run]]  # (loader, workers), what it times, timing


def run_loaders(
    cache_dir: Path, options: BenchOptions, console: Console, reference: ModuleType | None
) -> dict[str, Any]:
    """Index opens, memcpy, then every loader on the same cache (see `command.py`)."""
    results = _results_frame("loaders", options, reference)
    step = _stepper(console, options.wait_load)
    _check_warmup(cache_dir, options)
    results["index"] = measure_index_opens(cache_dir, reference, step)  # first: children fork from a small process
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
        if reference is not None:
            measures += stack.enter_context(_reference_measures(index, options, reference, len(plan), step))
        runs = _fastest_rounds(measures, options.rounds, step)
    results["runs"] = _with_ratios(runs, memcpy["mb_s"])
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


@contextlib.contextmanager
def _reference_measures(
    index: CacheIndex, options: BenchOptions, reference: ModuleType, batches: int, step: Step
) -> Iterator[list[Measure]]:
    """The reference's loader at each worker count, on the cache or (safetensors) on a `.pt` twin of it."""
    needs_twin = any(format_of(index.relative_path(i)) != "pt" for i in range(len(index)))
    twin = Path(tempfile.mkdtemp(prefix="image-edit-bench-pt-twin-")) if needs_twin else None
    root = twin or index.root

    def timed(workers: int, plan: list[list[int]], sizes: dict[int, int], files: list[Path]) -> Run:
        warm_page_cache(files)
        build = build_reference(reference, root, workers, options.prefetch_factor, options.batch_size)
        return timed_batches("reference", workers, build.dataloader, plan, options.warmup, sizes)

    try:
        if twin is not None:
            write_pt_twin_index(index, twin)
        measures: list[Measure] = []
        for workers in options.num_workers:
            build = build_reference(reference, root, workers, options.prefetch_factor, options.batch_size)
            # Its own sampler's batches: the same bucket structure, its own shuffle (the same in every build).
            plan = reference_plan(build.sampler, batches)
            if twin is not None:
                with step("writing .pt copies of the payloads the reference will read"):
                    convert_payloads(index, twin, sorted({i for batch in plan for i in batch}))
            files = reference_files(build.dataloader.dataset, {i for batch in plan for i in batch})
            sizes = {i: path.stat().st_size for i, path in files.items()}
            what = f"the reference loader with {workers} workers"
            measures.append((("reference", workers), what, partial(timed, workers, plan, sizes, list(files.values()))))
        yield measures
    finally:
        if twin is not None:
            shutil.rmtree(twin, ignore_errors=True)


def _with_ratios(runs: dict[tuple[str, int | None], Run], memcpy_mb_s: float) -> list[dict[str, Any]]:
    """Every run's numbers; ours also as ratios over the others at the same worker count."""
    rows = []
    for (loader, workers), run in runs.items():
        numbers = run.to_json(memcpy_mb_s)
        if loader == "ours":
            for other, key in (("naive", workers), ("bare", None), ("reference", workers)):
                base = runs.get((other, key))
                numbers[f"ours_over_{other}"] = None if base is None else ratio(numbers, base.to_json(memcpy_mb_s))
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
