"""Another loader timed beside ours on the same cache: what `bench_main(argv, other=...)` takes.

The package names no other loader: the repository's `benchmarks/versus_nemo` passes NVIDIA NeMo
Automodel's. The bench pickles the loader into its child processes (the index opens, the
worker-memory epochs), so an implementation holds names and paths and imports its library on use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..index.index import CacheIndex
    from .measure import Step
    from .run import BenchOptions, Measure


class LoaderBuild(Protocol):
    """A built loader and its batch sampler, as `DiffusionDataloaderBuild` holds them."""

    @property
    def dataloader(self) -> Iterable[Any]: ...

    @property
    def sampler(self) -> Any: ...


class OtherLoader(Protocol):
    """How the bench opens, builds and times another loader."""

    @property
    def name(self) -> str:
        """Its rows' name in the tables and the JSON."""
        ...

    def about(self) -> dict[str, str]:
        """What the report says about it beside its name (its package and version); kept in the JSON."""
        ...

    def open_index(self, cache_dir: str) -> Sized:
        """Open the cache's index as its users do; timed in a child process, its memory counted."""
        ...

    def build(self, cache_dir: str, num_workers: int, prefetch_factor: int, batch_size: int) -> LoaderBuild:
        """Its loader for one rank at epoch 0; the worker-memory epochs draw one whole epoch from it."""
        ...

    def measures(
        self, index: CacheIndex, options: BenchOptions, batches: int, step: Step
    ) -> AbstractContextManager[list[Measure]]:
        """Its timed runs at each of `options.num_workers`, `batches` batches each, warm-up included.

        Entered before the first round and left after the last: whatever it writes to read the cache
        (a copy in a format it reads) lives that long.
        """
        ...
