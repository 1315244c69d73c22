"""Plan one epoch of bucketed batches for every rank: a pure function of its inputs, in numpy.

An epoch is a sequence of *steps*. At each step every rank takes one batch, all from the same
bucket, so ranks always run the same shapes in lockstep and always have the same batch count.
Within a bucket the (shuffled) samples are padded by cycling until every rank gets the same
number, dealt round-robin to ranks, and cut into batches.

A mixture (`mixture_draw.py`) draws each epoch's samples first, some of them more than once; the plan
then deals *entries* (positions in that epoch's draw, each unique) and maps them to sample ids, so
an elastic re-deal tells a repeated sample's two draws apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np
import numpy.random  # numpy loads it on first use otherwise: 5-8 ms in a loader's first batch

BucketOrder = Literal["interleaved", "sequential"]
Tail = Literal["drop", "short", "pad"]  # short last batch: dropped, kept short, or filled by cycling


class EpochDraw(Protocol):
    """What an epoch draws from each bucket before it is dealt (a mixture's draw: `mixture_draw.Mixture`)."""

    def epoch_members(self, members: Sequence[np.ndarray], seed: int, epoch: int) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class EpochPlan:
    """Steps of one epoch; rank r's batch at step t is `flat[start[t] + r*size[t] : start[t] + (r+1)*size[t]]`.

    `flat` holds entries; `samples[entry]` is the sample id of an entry of a mixture's draw, and
    without `samples` (a single cache read once) entries are the sample ids.
    """

    world_size: int
    flat: np.ndarray  # [sum over steps of world_size * size] entries
    start: np.ndarray  # [T] int64 offset of each step in `flat`, in epoch order
    size: np.ndarray  # [T] int64 per-rank batch size of each step
    bucket: np.ndarray  # [T] int32 bucket id of each step
    samples: np.ndarray | None = None  # [entries] sample id of each entry, or None: entries are sample ids

    def __len__(self) -> int:
        return int(self.start.shape[0])

    def ids(self, entries: np.ndarray) -> np.ndarray:
        """The sample ids of `entries`."""
        return entries if self.samples is None else self.samples[entries]

    def batch(self, step: int, rank: int) -> np.ndarray:
        """Sample indices rank `rank` trains on at step `step`."""
        begin = int(self.start[step]) + rank * int(self.size[step])
        return self.ids(self.flat[begin : begin + int(self.size[step])])

    def step_entries(self, steps: slice | np.ndarray) -> np.ndarray:
        """All ranks' entries over a range of steps (with rank padding repeats)."""
        parts = [self.flat[s : s + self.world_size * n] for s, n in zip(self.start[steps], self.size[steps])]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.flat.dtype)

    def step_samples(self, steps: slice | np.ndarray) -> np.ndarray:
        """All ranks' sample indices over a range of steps (with rank padding repeats)."""
        return self.ids(self.step_entries(steps))


def rng_for(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on `seed` and `keys`, identical on every rank."""
    return np.random.default_rng([seed & 0xFFFFFFFF, *keys])


def deal_bucket(members: np.ndarray, world_size: int, batch_size: int, tail: Tail) -> tuple[np.ndarray, np.ndarray]:
    """Deal one bucket to ranks; return its steps' samples (step-major, then rank) and per-step sizes."""
    n = members.shape[0]
    if n == 0:
        return members[:0], np.zeros(0, dtype=np.int64)
    per_rank = -(-n // world_size)
    if tail == "pad":
        per_rank = -(-per_rank // batch_size) * batch_size
    dealt = np.resize(members, per_rank * world_size).reshape(per_rank, world_size).T  # [W, per_rank]
    full, rest = divmod(per_rank, batch_size)
    blocks = [dealt[:, : full * batch_size].reshape(world_size, full, batch_size).transpose(1, 0, 2).reshape(-1)]
    sizes = [np.full(full, batch_size, dtype=np.int64)]
    if rest and tail == "short":
        blocks.append(dealt[:, full * batch_size :].reshape(-1))  # rank-major: each rank `rest` samples
        sizes.append(np.array([rest], dtype=np.int64))
    return np.concatenate(blocks), np.concatenate(sizes)


def step_count(bucket_sizes: Sequence[int], batch_sizes: Sequence[int], world_size: int, drop_last: bool) -> int:
    """Steps of a fresh epoch (no elastic history), by arithmetic alone."""
    total = 0
    for n, batch_size in zip(bucket_sizes, batch_sizes):
        per_rank = -(-n // world_size)
        total += per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    return total


def plan_steps(
    members: Sequence[np.ndarray],
    batch_sizes: Sequence[int],
    world_size: int,
    tail: Tail,
    order: BucketOrder,
    rng: np.random.Generator | None,
) -> EpochPlan:
    """Deal each bucket's ordered members, then order the steps (shuffled if `rng` and interleaved)."""
    flats, sizes, buckets = [], [], []
    for bucket_id, (bucket, batch_size) in enumerate(zip(members, batch_sizes)):
        flat, size = deal_bucket(bucket, world_size, batch_size, tail)
        flats.append(flat)
        sizes.append(size)
        buckets.append(np.full(size.shape[0], bucket_id, dtype=np.int32))
    size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    bucket = np.concatenate(buckets) if buckets else np.zeros(0, dtype=np.int32)
    start = np.zeros(size.shape[0], dtype=np.int64)
    np.cumsum(size[:-1] * world_size, out=start[1:])  # [T] offsets in bucket-after-bucket order
    if order == "interleaved" and rng is not None:
        perm = rng.permutation(size.shape[0])  # [T]
        start, size, bucket = start[perm], size[perm], bucket[perm]
    flat = np.concatenate(flats) if flats else np.zeros(0, dtype=np.int64)
    return EpochPlan(world_size=world_size, flat=flat, start=start, size=size, bucket=bucket)


def shuffled_members(
    members: Sequence[np.ndarray],
    seed: int,
    epoch: int,
    shuffle: bool,
    shard_of: np.ndarray | None = None,
    shard_window: int = 0,
) -> list[np.ndarray]:
    """Each bucket's members, permuted from (seed, epoch, bucket) when shuffling.

    With `shard_of` (sample -> shard number of a packed cache) and `shard_window` > 0, the shuffle
    keeps reads local: a bucket's shards are put in a random order, and samples are shuffled only
    among those of `shard_window` consecutive shards of that order.
    """
    if not shuffle:
        return list(members)
    if shard_of is None or shard_window <= 0:
        return [rng_for(seed, epoch, b).permutation(m) for b, m in enumerate(members)]
    return [
        shard_local_permutation(m, shard_of[m], rng_for(seed, epoch, b), shard_window) for b, m in enumerate(members)
    ]


def shard_local_permutation(
    members: np.ndarray, shards: np.ndarray, rng: np.random.Generator, window: int
) -> np.ndarray:
    """`members` with their shards in random order and samples shuffled within windows of `window` shards."""
    distinct = np.unique(shards)  # [S] this bucket's shards, ascending
    rank = np.empty(int(distinct.max()) + 1 if distinct.size else 0, dtype=np.int64)
    rank[rng.permutation(distinct)] = np.arange(distinct.size)  # shard -> its place in the shuffled order
    group = rank[shards] // window  # [n] window of each member
    keys = rng.random(members.shape[0])  # [n] random order inside a window
    return members[np.lexsort((keys, group))]


def plan_epoch(
    members: Sequence[np.ndarray],
    batch_sizes: Sequence[int],
    *,
    seed: int,
    epoch: int,
    world_size: int,
    shuffle: bool,
    drop_last: bool,
    order: BucketOrder,
    history: Sequence[tuple[int, int]] = (),
    shard_of: np.ndarray | None = None,
    shard_window: int = 0,
    mixture: EpochDraw | None = None,
) -> EpochPlan:
    """The plan every rank follows for `epoch`.

    `history` lists earlier segments of this epoch run at other world sizes, as
    `(world_size, steps consumed)`. Their consumed samples are removed and the rest is dealt
    again to `world_size` ranks (elastic resume); continuation segments pad short tails instead
    of dropping them, so no sample that was due in this epoch is lost. `shard_of` and
    `shard_window` make the shuffle shard-local (see `shuffled_members`). With `mixture`, the
    buckets' members are first drawn for this epoch (`Mixture.epoch_members`).
    """
    samples = None
    if mixture is not None:
        members, samples = as_entries(mixture.epoch_members(members, seed, epoch))
        if shard_of is not None:
            shard_of = shard_of[samples]  # shuffling looks shards up by entry
    ordered = shuffled_members(members, seed, epoch, shuffle, shard_of, shard_window)
    tail: Tail = "drop" if drop_last else "short"
    rng = rng_for(seed, epoch, 1 << 20) if shuffle else None
    worlds = [w for w, _ in history] + [world_size]
    plan = plan_steps(ordered, batch_sizes, worlds[0], tail, order, rng)
    for segment, (_, consumed) in enumerate(history, start=1):
        ordered = remaining_members(plan, consumed, len(members))
        rng = rng_for(seed, epoch, 1 << 20, segment) if shuffle else None
        plan = plan_steps(ordered, batch_sizes, worlds[segment], "pad" if drop_last else "short", order, rng)
    return plan if samples is None else replace(plan, samples=samples)


def as_entries(drawn: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per bucket, entries numbering the drawn samples (consecutive, bucket after bucket), and entry -> sample id.

    Shuffling an array permutes it by its length alone, so entries shuffled and mapped back give
    the same ids as the drawn ids shuffled themselves.
    """
    samples = np.concatenate(drawn) if drawn else np.zeros(0, dtype=np.int64)
    entry_type = np.int32 if samples.shape[0] < 2**31 else np.int64
    ends = np.cumsum([d.shape[0] for d in drawn], dtype=np.int64)
    entries = [np.arange(end - d.shape[0], end, dtype=entry_type) for d, end in zip(drawn, ends)]
    return entries, samples


def remaining_members(plan: EpochPlan, consumed: int, num_buckets: int) -> list[np.ndarray]:
    """Per bucket, the entries of `plan` not trained on in its first `consumed` steps, in plan order."""
    done = plan.step_entries(slice(0, consumed))
    remaining = []
    for bucket_id in range(num_buckets):
        steps = np.flatnonzero(plan.bucket[consumed:] == bucket_id) + consumed
        if steps.size == 0:
            remaining.append(np.zeros(0, dtype=plan.flat.dtype))
            continue
        entries = plan.step_entries(steps)
        _, first = np.unique(entries, return_index=True)
        entries = entries[np.sort(first)]  # drop rank-padding repeats, keep order
        remaining.append(entries[~np.isin(entries, done)])
    return remaining
