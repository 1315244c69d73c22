"""NVIDIA NeMo Automodel's image-edit loader as the bench's other loader (`image_edit_data.bench.other`).

It is imported from the environment (`pip install --no-deps nemo-automodel`) or from an unpacked
wheel given as `--reference-path`; nothing is downloaded. It reads NeMo's `.pt` payloads only, so a
safetensors cache reaches it as a `.pt` twin (`pt_twin.py`): the same records, naming `.pt` copies of
the payloads it is about to read.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import itertools
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from image_edit_data.bench.measure import Run, Step, timed_batches, warm_page_cache
from image_edit_data.bench.run import BenchOptions, Measure
from image_edit_data.index.index import CacheIndex
from image_edit_data.payload.payload import format_of

from .pt_twin import convert_payloads, write_pt_twin_index

REFERENCE_MODULE = "nemo_automodel.components.datasets.diffusion.image_edit_dataset"
INSTALL = "pip install --no-deps nemo-automodel"


def import_reference(path: str | None) -> ModuleType:
    """NeMo's image-edit dataset module, from sys.path or `path`; a sentence on how to get it if absent."""
    if path is not None:
        if not Path(path).is_dir():
            raise ValueError(f"--reference-path: {path} is not a directory")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(REFERENCE_MODULE)
    except ImportError as error:
        where = f" (sys.path and {path})" if path else ""
        raise ValueError(
            f"cannot import NeMo Automodel's loader {REFERENCE_MODULE}{where}: {error}. "
            f"Install it with `{INSTALL}` (it needs only torch and torchdata, which are here already), "
            "or unpack its wheel into a directory and pass --reference-path DIR"
        ) from None


def import_root(module: ModuleType) -> str:
    """The sys.path entry `module` was imported from (the directory holding its top-level package)."""
    root = Path(str(module.__file__))
    for _ in module.__name__.split("."):
        root = root.parent
    return str(root)


@dataclass(frozen=True)
class NemoLoader:
    """NeMo Automodel's `ImageEditDataset` and `ImageEditDataloaderConfig`, built as its users build them."""

    import_root: str  # where its package is imported from, in the bench's child processes too
    name: str = "NeMo Automodel"

    @classmethod
    def find(cls, path: str | None) -> NemoLoader:
        """The loader importable from the environment or from `path`; a ValueError saying how to get it if not."""
        return cls(import_root(import_reference(path)))

    def module(self) -> ModuleType:
        """Its image-edit dataset module."""
        if self.import_root not in sys.path:  # a fork server may have started before --reference-path was added
            sys.path.insert(0, self.import_root)
        return importlib.import_module(REFERENCE_MODULE)

    def about(self) -> dict[str, str]:
        """Its version and module, and what it reads."""
        try:
            version = importlib.metadata.version("nemo_automodel")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        reads = ".pt payloads (a safetensors cache's through .pt copies)"
        return {"version": version, "module": REFERENCE_MODULE, "reads": reads}

    def open_index(self, cache_dir: str) -> Any:
        """Its dataset: it parses the index's JSON shards on every open."""
        return self.module().ImageEditDataset(cache_dir)

    def build(self, cache_dir: str, num_workers: int, prefetch_factor: int, batch_size: int) -> Any:
        """Its `DiffusionDataloaderBuild` for one rank, at epoch 0."""
        config = self.module().ImageEditDataloaderConfig(
            cache_dir=cache_dir, num_workers=num_workers, prefetch_factor=prefetch_factor
        )
        build = config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
        build.sampler.set_epoch(0)
        return build

    @contextlib.contextmanager
    def measures(self, index: CacheIndex, options: BenchOptions, batches: int, step: Step) -> Iterator[list[Measure]]:
        """Its loader at each worker count, on the cache or (safetensors) on a `.pt` twin of it."""
        needs_twin = any(format_of(index.relative_path(i)) != "pt" for i in range(len(index)))
        twin = Path(tempfile.mkdtemp(prefix="image-edit-bench-pt-twin-")) if needs_twin else None
        root = str(twin or index.root)

        def timed(workers: int, plan: list[list[int]], sizes: dict[int, int], files: list[Path]) -> Run:
            warm_page_cache(files)
            build = self.build(root, workers, options.prefetch_factor, options.batch_size)
            return timed_batches(self.name, workers, build.dataloader, plan, options.warmup, sizes)

        try:
            if twin is not None:
                write_pt_twin_index(index, twin)
            measures: list[Measure] = []
            for workers in options.num_workers:
                build = self.build(root, workers, options.prefetch_factor, options.batch_size)
                # Its own sampler's batches: the same bucket structure, its own shuffle (the same in every build).
                plan = first_batches(build.sampler, batches)
                if twin is not None:
                    with step("writing .pt copies of the payloads NeMo Automodel's loader will read"):
                        convert_payloads(index, twin, sorted({i for batch in plan for i in batch}))
                files = payload_files(build.dataloader.dataset, {i for batch in plan for i in batch})
                sizes = {i: path.stat().st_size for i, path in files.items()}
                what = f"{self.name}'s loader with {workers} workers"
                measures.append(((self.name, workers), what, partial(timed, workers, plan, sizes, [*files.values()])))
            yield measures
        finally:
            if twin is not None:
                shutil.rmtree(twin, ignore_errors=True)


def first_batches(sampler: Iterable[list[int]], count: int) -> list[list[int]]:
    """The first `count` batches its sampler yields (it replans from scratch on each `iter`)."""
    return [list(batch) for batch in itertools.islice(iter(sampler), count)]


def payload_files(dataset: Any, samples: Iterable[int]) -> dict[int, Path]:
    """Payload file of each sample of its dataset."""
    root = Path(dataset.cache_dir)
    return {i: root / str(dataset.metadata[i]["cache_file"]) for i in samples}
