"""The distributed bucket batch sampler: slices the epoch plan from a small resumable state.

State is `{"version", "epoch", "consumed", "history", "fingerprint"}`, identical on every rank
(Lightning restores rank 0's copy everywhere). `consumed` counts the batches of this epoch handed
to the *consumer* (the training loop), including those of earlier world sizes listed in `history`.
Behind our loader (`workers/resumable_loader.py`) the loader reports each batch as it hands it over, so
batches that workers merely prefetched are never counted and `state_dict()` is exact at any time;
a sampler iterated by anything else counts a batch when it hands it out. A new iteration starts
at `consumed`: batches prefetched by an abandoned pass are handed out again, never skipped.

Epochs after a restore: `set_epoch(e)` with the restored epoch continues it where it stopped (an
epoch restored at its end has nothing left), any other `e` starts `e` from its first batch, and
the order of `load_state_dict` and `set_epoch` does not matter as long as both come before the
next iteration. Without `set_epoch`, an iteration after one that ran its epoch to the end starts
the next epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .mismatch import CHECKSUMS, fingerprint_changes
from .mixture_draw import Mixture
from .plan import BucketOrder, EpochPlan, plan_epoch, step_count

STATE_VERSION = 1
BUCKET_ORDERS = ("interleaved", "sequential")


class PlannedBatch(list):
    """A batch of sample indices that also knows its place in the epoch plan (it survives pickling).

    The place travels with the batch to the worker and into the collated batch's metadata, so the
    training process always knows which batch it *trained on*, however far prefetching ran ahead.
    """

    def __init__(self, indices: list[int], epoch: int, step: int) -> None:
        super().__init__(indices)
        self.epoch = epoch
        self.step = step


class BatchObserver(Protocol):
    """Told of each batch as the sampler hands it out (the remote shard prefetcher); closed with its loader."""

    def __call__(self, sampler: Any, step: int) -> None: ...

    def close(self) -> None: ...


class ResumeMismatchError(ValueError):
    """Saved sampler state does not fit this sampler's data or configuration."""


class BucketBatchSampler:
    """Yields this rank's batches (lists of sample indices), one compound signature per batch.

    Every rank gets the same number of batches; the order depends only on `(seed, epoch)`.
    Call `set_epoch(e)` before each epoch (Lightning does, through the DataModule's loader).
    """

    def __init__(
        self,
        *,
        bucket_members: Sequence[np.ndarray],
        batch_sizes: Sequence[int],
        rank: int = 0,
        world_size: int = 1,
        seed: int = 42,
        shuffle: bool = True,
        drop_last: bool = True,
        bucket_order: BucketOrder = "interleaved",
        epoch: int = 0,
        data_fingerprint: str = "",
        unchecked: bool = False,
        max_batches: int | None = None,
        elastic: bool = False,
        shard_of: np.ndarray | None = None,
        shard_window: int = 0,
        mixture: Mixture | None = None,
    ) -> None:
        check_rank(rank, world_size)
        if len(batch_sizes) != len(bucket_members):
            raise ValueError(f"got {len(batch_sizes)} batch sizes for {len(bucket_members)} buckets")
        if any(b < 1 for b in batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        if bucket_order not in BUCKET_ORDERS:
            raise ValueError(f"bucket_order must be one of {BUCKET_ORDERS}, got {bucket_order!r}")
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches must be non-negative, got {max_batches}")
        # int32 halves the memory traffic of planning, which walks every sample index of the epoch.
        index_type = np.int32 if sum(len(m) for m in bucket_members) < 2**31 else np.int64
        self.bucket_members = [np.asarray(m, dtype=index_type) for m in bucket_members]
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.bucket_order: BucketOrder = bucket_order
        self.max_batches = max_batches
        self.elastic = elastic
        self.data_fingerprint = data_fingerprint
        # The data is a packed cache without member checksums: recorded, so that a checkpoint of checked
        # data never resumes on a repack without them (mismatch.py).
        self.unchecked = unchecked
        # Packed caches: sample -> shard, and the shard-local shuffle window (0: shuffle whole buckets).
        self.shard_of = shard_of
        self.shard_window = shard_window
        # The sources the members come from and each one's share of an epoch (None: every member once per epoch).
        self.mixture = mixture
        # Called as observer(self, step) as each batch is handed out, and with step = len(self) once the
        # epoch is handed out (the remote shard prefetcher).
        self.observer: BatchObserver | None = None
        self.epoch = epoch
        self.consumed = 0
        self.history: list[tuple[int, int]] = []
        # True when a loader reports what its consumer took (`note_consumed`, `note_pass_end`); otherwise
        # a batch counts as consumed when it is handed out.
        self.consumption_tracked = False
        # Set when a pass ran the epoch to its end; the next iteration then starts the next epoch.
        self._ran_to_end = False
        # The epoch named by `set_epoch` since the last iteration began (None: none named). A state
        # loaded after it still honours it, since torchdata applies loader state only at `iter()`.
        self._requested_epoch: int | None = None
        self._plan_key: tuple[Any, ...] | None = None
        self._plan: EpochPlan | None = None

    def close(self) -> None:
        """Stop what the observer runs (prefetch threads, shard pins); it starts again at the next batch handed out."""
        if self.observer is not None:
            self.observer.close()

    @property
    def sampler(self) -> BucketBatchSampler:
        """Itself: Lightning calls `loader.batch_sampler.sampler.set_epoch`, so the epoch reaches us."""
        return self

    def plan(self) -> EpochPlan:
        """The current epoch's plan (cached; recomputed when epoch or history change)."""
        key = (self.epoch, tuple(self.history))
        if self._plan is None or self._plan_key != key:
            self._plan = plan_epoch(
                self.bucket_members,
                self.batch_sizes,
                seed=self.seed,
                epoch=self.epoch,
                world_size=self.world_size,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
                order=self.bucket_order,
                history=self.history,
                shard_of=self.shard_of,
                shard_window=self.shard_window,
                mixture=self.mixture,
            )
            self._plan_key = key
        return self._plan

    @property
    def segment_start(self) -> int:
        """Steps of this epoch taken at earlier world sizes (elastic resume); the plan starts after them."""
        return sum(steps for _, steps in self.history)

    def __len__(self) -> int:
        """Batches this rank takes in the current epoch (the same on every rank), counting earlier segments."""
        steps = self.segment_start + len(self.plan())
        return steps if self.max_batches is None else min(steps, self.max_batches)

    def steady_length(self) -> int:
        """Batches of an epoch without elastic history: what every later epoch has on these ranks."""
        sizes = [len(m) for m in self.bucket_members]
        if self.mixture is not None:
            sizes = self.mixture.bucket_draws(self.bucket_members)
        steps = step_count(sizes, self.batch_sizes, self.world_size, self.drop_last)
        return steps if self.max_batches is None else min(steps, self.max_batches)

    def __iter__(self) -> Iterator[list[int]]:
        self._requested_epoch = None
        if self._ran_to_end:
            self.advance_epoch(self.epoch + 1)  # the last epoch ran to its end and nobody called set_epoch
        return self._batches(self.epoch, self.consumed, len(self), self.plan(), self.segment_start)

    def _batches(self, epoch: int, step: int, total: int, plan: EpochPlan, start: int) -> Iterator[list[int]]:
        # The plan and bounds are fixed when the pass starts, so a pass prefetched ahead keeps its epoch's
        # batches even if `set_epoch` is called before it is abandoned.
        while step < total:
            if self.observer is not None:
                self.observer(self, step)
            batch = PlannedBatch(plan.batch(step - start, self.plan_row).tolist(), epoch, step)
            step += 1
            if not self.consumption_tracked:
                self.consumed = step
            yield batch
        if self.observer is not None:
            self.observer(self, total)
        if not self.consumption_tracked:
            self._ran_to_end = True

    def note_consumed(self, epoch: int, step: int) -> None:
        """The consumer received batch `step` of `epoch`: the position moves just past it."""
        if epoch == self.epoch:
            self.consumed = step + 1

    def note_pass_end(self) -> None:
        """The consumer saw the pass end: the next iteration starts the next epoch unless `set_epoch` says otherwise."""
        if self.epoch_finished:
            self._ran_to_end = True

    def batch_for(self, step: int) -> np.ndarray:
        """This rank's `step`-th batch of the current epoch."""
        return self.plan().batch(step - self.segment_start, self.plan_row)

    @property
    def plan_row(self) -> int:
        """Which of the plan's per-rank rows this sampler takes."""
        return self.rank

    def advance_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch."""
        self.epoch, self.consumed, self.history = epoch, 0, []
        self._ran_to_end = False

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch `epoch`: the current epoch continues where it stopped, another starts fresh."""
        self._requested_epoch = epoch
        self._ran_to_end = False
        if epoch != self.epoch:
            self.advance_epoch(epoch)

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same samples on resume.

        A single cache read once per epoch keeps the keys it always had, so older checkpoints still
        match; a mixture of several sources replaces `data` with each source's data and weight. Data
        read unchecked (a packed cache without member checksums) adds `member_checksums: False`.
        """
        mixed = self.mixture.fingerprint() if self.mixture is not None else {}
        data = {"data": self.data_fingerprint, **({CHECKSUMS: False} if self.unchecked else {})}
        return {
            **({} if "sources" in mixed else data),
            "batch_sizes": list(self.batch_sizes),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "bucket_order": self.bucket_order,
            "world_size": self.world_size,
            **({"shard_window": self.shard_window} if self.shard_window else {}),  # absent: old checkpoints match
            **mixed,
        }

    def state_dict(self) -> dict[str, Any]:
        """A fresh dict (never aliased: whoever keeps it keeps this moment's position)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "history": [list(h) for h in self.history],
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any], allow_changes: Sequence[str] = ()) -> None:
        """Restore a position by assignment; refuse one saved under different data or config.

        A changed world size continues the same epoch on the new ranks when the sampler was built
        with `elastic=True`; other changes are refused unless named in `allow_changes`.
        """
        state = migrate_state(state)
        saved = state["fingerprint"]
        allowed = set(allow_changes) | ({"world_size"} if self.elastic else set())
        changed = fingerprint_changes(saved, self.fingerprint(), allowed)  # names only label: a renamed source resumes
        if changed:
            elastic_hint = any(line.startswith("world_size") for line in changed)
            hint = " (set elastic=True to continue on a new world size)" if elastic_hint else ""
            raise ResumeMismatchError(
                "cannot resume: the saved data position does not fit: " + "; ".join(changed) + hint
            )
        self.epoch = int(state["epoch"])
        self.history = [(int(w), int(c)) for w, c in state["history"]]
        self.consumed = int(state["consumed"])
        self._ran_to_end = False
        if saved.get("world_size") != self.world_size:
            # The epoch was planned for the old ranks: keep that plan's samples, deal the rest anew.
            self.history.append((int(saved["world_size"]), self.consumed - self.segment_start))
        if self._requested_epoch is not None and self._requested_epoch != self.epoch:
            self.advance_epoch(self._requested_epoch)

    @property
    def epoch_finished(self) -> bool:
        """Whether every batch of the current epoch was handed out."""
        return self.consumed >= len(self)


class EvalBatchSampler(BucketBatchSampler):
    """Every sample exactly once across ranks, in a fixed order, for validation and test.

    The whole epoch is planned as if for one rank (no shuffle, no rank padding, short last
    batches kept) and its batches are dealt round-robin, so ranks may differ by one batch and no
    sample is counted twice in a metric.
    """

    def plan(self) -> EpochPlan:
        if self._plan is None:
            whole = plan_epoch(
                self.bucket_members,
                self.batch_sizes,
                seed=self.seed,
                epoch=0,
                world_size=1,
                shuffle=False,
                drop_last=False,
                order="sequential",
            )
            mine = slice(self.rank, None, self.world_size)
            self._plan = EpochPlan(
                world_size=1,
                flat=whole.flat,
                start=whole.start[mine],
                size=whole.size[mine],
                bucket=whole.bucket[mine],
                samples=whole.samples,
            )
        return self._plan

    def __iter__(self) -> Iterator[list[int]]:
        # Every evaluation run covers the whole set, however far the last one went.
        self.consumed, self._ran_to_end = 0, False
        return self._batches(self.epoch, 0, len(self), self.plan(), 0)

    @property
    def plan_row(self) -> int:
        """The plan holds only this rank's batches, in its one row."""
        return 0


def check_rank(rank: int, world_size: int) -> None:
    """Refuse impossible ranks and world sizes with a clear message."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"dp_world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"dp_rank must be in [0, {world_size}), got {rank!r}")


def migrate_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Bring a saved sampler state to the current version, or explain why it cannot be read."""
    if not isinstance(state, Mapping) or "version" not in state:
        raise ResumeMismatchError(f"cannot resume: not an image-edit-data sampler state: {state!r:.200}")
    version = state["version"]
    if version != STATE_VERSION:
        newer = isinstance(version, int) and version > STATE_VERSION
        raise ResumeMismatchError(
            f"cannot resume: sampler state version {version} was written by a "
            f"{'newer' if newer else 'different'} image-edit-data; this one reads version {STATE_VERSION}"
            + (" (upgrade the package)" if newer else "")
        )
    missing = {"epoch", "consumed", "history", "fingerprint"} - set(state)
    if missing:
        raise ResumeMismatchError(f"cannot resume: sampler state lacks {sorted(missing)}")
    return dict(state)
