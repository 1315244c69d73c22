"""The object the DataModule hands to Lightning in place of a DataLoader.

Lightning rebuilds any `DataLoader` under DDP to inject a `DistributedSampler`, which would
replace our bucket batch sampler and shard the data twice. An object that is not a DataLoader
is left alone with default Trainer flags, so this thin wrapper is what makes
`use_distributed_sampler=True` (the default) safe without the user setting anything.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, NoReturn

from ..contract.batch import Batch
from ..sampling.sampler import BucketBatchSampler
from ..workers.resumable_loader import ResumableDataLoader


class LightningLoader:
    """Iterates a ResumableDataLoader; exposes its sampler so Lightning's `set_epoch` reaches it."""

    def __init__(self, loader: ResumableDataLoader, sampler: BucketBatchSampler) -> None:
        self.loader = loader
        self.batch_sampler = sampler
        self._batches: Generator[Batch, None, None] | None = None

    @property
    def sampler(self) -> BucketBatchSampler:
        """Lightning calls `set_epoch` on `loader.sampler` at the start of every epoch."""
        return self.batch_sampler

    @property
    def dataset(self) -> Any:
        """The wrapped loader's dataset."""
        return self.loader.dataset

    def __len__(self) -> int:
        # Lightning reads this once per fit. After an elastic resume the current epoch's length
        # differs from later epochs'; report the larger, since a shorter epoch simply ends early.
        return max(len(self.loader), self.batch_sampler.steady_length())

    def __iter__(self) -> Iterator[Batch]:
        # A generator, so Lightning's probing `iter()` starts no worker pool until it is used. The pool
        # itself persists across passes (workers/resumable_loader.py): an epoch change forks nothing.
        if self._batches is not None:
            self._batches.close()  # a pass Lightning stopped early, e.g. at its length
        batches = self._generate()
        self._batches = batches
        return batches

    def close(self) -> None:
        """Stop the current pass and shut the worker pool down now.

        Lightning shuts down the workers only of loaders that are DataLoaders; without this, a
        run that ends or fails keeps its workers until garbage collection, which may come late
        and then waits on queues half torn down.
        """
        if self._batches is not None:
            self._batches.close()
            self._batches = None
        self.loader.close()

    def _generate(self) -> Generator[Batch, None, None]:
        # Lightning does not prefetch from sized loaders: a batch handed over here is the one it trains on
        # next, and the loader moves the sampler's consumed position as it hands it over.
        yield from self.loader

    def state_dict(self) -> dict[str, Any]:
        """Empty: the DataModule owns the data position, so Lightning must not restore a second copy."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Ignore Lightning's loader state (see `state_dict`)."""


class FailedLoader:
    """Stands in for a loader that could not be built and raises that error at Lightning's first use of it.

    Lightning 2.6 requests loaders with `DataLoader.__init__`/`__setattr__` patched and restores them
    only when the request returns: an error raised inside it leaves them patched for the rest of the
    process, and every later loader then keeps its iterators alive. Lightning's first use (it probes
    `iter()` right after the request, past its rank barrier) raises the error outside the patch.
    """

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _raise(self) -> NoReturn:
        if isinstance(self.error, TypeError):  # Lightning reads a TypeError from iter() as "not a loader"
            raise RuntimeError(f"building the loader failed: {self.error}") from self.error
        raise self.error

    def __iter__(self) -> Iterator[Batch]:
        self._raise()

    def __len__(self) -> int:
        self._raise()

    def close(self) -> None:
        """Nothing to shut down."""
