"""The object the DataModule hands to Lightning in place of a DataLoader.

Lightning rebuilds any `DataLoader` under DDP to inject a `DistributedSampler`, which would
replace our bucket batch sampler and shard the data twice. An object that is not a DataLoader
is left alone with default Trainer flags, so this thin wrapper is what makes
`use_distributed_sampler=True` (the default) safe without the user setting anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from ..contract.batch import Batch
from ..sampling.sampler import BucketBatchSampler


class LightningLoader:
    """Iterates a StatefulDataLoader; exposes its sampler so Lightning's `set_epoch` reaches it."""

    def __init__(self, loader: StatefulDataLoader, sampler: BucketBatchSampler) -> None:
        self.loader = loader
        self.batch_sampler = sampler
        self.position: tuple[int, int] | None = None  # (epoch, batches of it handed to training)

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
        # A generator function, so Lightning's probing `iter()` starts no worker pool until used.
        sampler = self.batch_sampler
        self.position = (sampler.epoch, sampler.consumed)
        for batch in self.loader:
            # Lightning does not prefetch from sized loaders: a batch handed over here is the one it
            # trains on next, so this is the trained position whenever a checkpoint is taken.
            position = batch["metadata"].get("position")
            if position is not None:
                self.position = (position[0], position[1] + 1)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Empty: the DataModule owns the data position, so Lightning must not restore a second copy."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Ignore Lightning's loader state (see `state_dict`)."""
