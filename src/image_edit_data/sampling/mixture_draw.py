"""What an epoch of a mixture draws: each source's share of the epoch, its samples repeated or subsampled.

Sources lie end to end in one sample space (source i holds ids `[offsets[i], offsets[i+1])`) and
buckets hold ids of every source with that compound signature. An epoch draws `samples_per_epoch`
samples (default: the sources' total); source i gets `N * w_i / sum(w)` of them, rounded by largest
remainder so the quotas sum to N, and splits its quota over its buckets in proportion to their
sizes (largest remainder again), so a source keeps its own mix of shapes and every epoch has the
same number of steps. Each (source, bucket) *stratum* of n members with quota q draws each member
`q // n` or `q // n + 1` times per epoch, the extra draws rotating through passes over its members
(`stratum_draw.py`): a stratum larger than its quota is subsampled, and the next epoch continues
the same pass, so every sample is drawn before any is drawn again. Drawing an epoch costs time and
memory in proportion to the quota, not to the stratum. One source drawn at its own size draws
every sample once, which is the plan of a single cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .stratum_draw import draw_positions

DRAW_KEY = 1 << 22  # separates the draw's keyed orders from the plan's shuffle streams (`plan.rng_for`)
# Which draw a mixture's epochs take, in its resume fingerprint. Draw 1 (earlier versions, no key) read each
# stratum through whole permutations per pass; draw 2 rotates the extra draws (`stratum_draw.py`).
DRAW_VERSION = 2


@dataclass(frozen=True)
class Mixture:
    """Sizes and weights of the sources of one sample space, and the epoch length."""

    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    samples_per_epoch: int | None = None
    fingerprints: tuple[str, ...] = ()  # each source's index fingerprint, for the resume check
    names: tuple[str, ...] = ()  # each source's name, for messages (a renamed source still resumes)
    unchecked: tuple[bool, ...] = ()  # per source: a packed cache without member checksums, for the resume check

    def __post_init__(self) -> None:
        if not self.sizes or len(self.weights) != len(self.sizes):
            raise ValueError(f"a mixture needs one weight per source, got sizes {self.sizes} weights {self.weights}")
        for what, given in (("fingerprints", self.fingerprints), ("names", self.names), ("unchecked", self.unchecked)):
            if given and len(given) != len(self.sizes):
                raise ValueError(f"got {len(given)} {what} for {len(self.sizes)} sources")
        for i, weight in enumerate(self.weights):
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
                raise ValueError(f"sources[{i}].weight: expected a positive number, got {weight!r}")
        n = self.samples_per_epoch
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"samples_per_epoch must be a positive integer, got {n!r}")

    @property
    def epoch_samples(self) -> int:
        """N: samples drawn per epoch over all sources."""
        return sum(self.sizes) if self.samples_per_epoch is None else self.samples_per_epoch

    @property
    def reads_each_sample_once(self) -> bool:
        """One source drawn at its own size: every sample once per epoch, the plan of a single cache."""
        return len(self.sizes) == 1 and self.epoch_samples == self.sizes[0]

    @property
    def offsets(self) -> np.ndarray:
        """[S + 1] first id of each source, then the total."""
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    @property
    def targets(self) -> list[float]:
        """Each source's target share of the epoch: its weight over the sum of weights."""
        total = sum(self.weights)
        return [w / total for w in self.weights]

    def quotas(self) -> list[int]:
        """Samples each source draws per epoch: `N * w_i / sum(w)` by largest remainder (exact rationals)."""
        exact = [Fraction(w) for w in self.weights]
        total = sum(exact)
        shares = [self.epoch_samples * w / total for w in exact]
        quotas = [int(s) for s in shares]  # floor: shares are non-negative
        by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - quotas[i]), i))
        for i in by_remainder[: self.epoch_samples - sum(quotas)]:
            quotas[i] += 1
        return quotas

    def strata(self, members: Sequence[np.ndarray]) -> list[list[tuple[slice, int]]]:
        """Per source, per bucket: (its slice of the bucket's ascending ids, its quota of draws per epoch)."""
        offsets = self.offsets
        # [S + 1, B] where each source's ids begin in each bucket's ascending member array (and the end); offsets
        # in the members' type, or searchsorted would copy a whole bucket to the wider type
        bounds = np.stack([np.searchsorted(m, offsets.astype(m.dtype)) for m in members], axis=1) if members else None
        result: list[list[tuple[slice, int]]] = []
        for source, quota in enumerate(self.quotas()):
            if bounds is None:
                result.append([])
                continue
            begin, end = bounds[source], bounds[source + 1]
            quotas = split_quota(quota, (end - begin).astype(np.int64))  # [B] in proportion to stratum sizes
            result.append([(slice(int(b), int(e)), int(q)) for b, e, q in zip(begin, end, quotas)])
        return result

    def bucket_draws(self, members: Sequence[np.ndarray]) -> list[int]:
        """Samples each bucket draws per epoch (the same every epoch)."""
        total = [0] * len(members)
        for source in self.strata(members):
            for bucket, (_, quota) in enumerate(source):
                total[bucket] += quota
        return total

    def epoch_members(self, members: Sequence[np.ndarray], seed: int, epoch: int) -> list[np.ndarray]:
        """Per bucket, the ids epoch `epoch` draws, ascending, each as often as it is drawn."""
        parts: list[list[np.ndarray]] = [[] for _ in members]
        for source, strata in enumerate(self.strata(members)):
            for bucket, (where, quota) in enumerate(strata):
                stratum = members[bucket][where]  # [n] this source's ids in this bucket (a view)
                if quota and stratum.size:
                    key = (seed & 0xFFFFFFFF, DRAW_KEY, source, bucket)
                    parts[bucket].append(stratum[draw_positions(stratum.size, quota, epoch, key)])
        dtype = members[0].dtype if members else np.int64
        return [np.concatenate(p) if p else np.zeros(0, dtype=dtype) for p in parts]

    def fingerprint(self) -> dict[str, Any]:
        """What a resume must match beyond a single cache's fingerprint (nothing for a cache read once per epoch).

        `sources[i].name` only labels messages: the sampler never refuses a renamed source.
        """
        keys: dict[str, Any] = {}
        if self.reads_each_sample_once:
            return keys
        keys["mixture_draw"] = DRAW_VERSION
        if self.epoch_samples != sum(self.sizes):
            keys["samples_per_epoch"] = self.epoch_samples
        if len(self.sizes) > 1:
            keys["sources"] = len(self.sizes)
            for i, weight in enumerate(self.weights):
                keys[f"sources[{i}].data"] = self.fingerprints[i] if self.fingerprints else None
                keys[f"sources[{i}].weight"] = float(weight)
                if self.names:
                    keys[f"sources[{i}].name"] = self.names[i]
                if self.unchecked and self.unchecked[i]:
                    keys[f"sources[{i}].member_checksums"] = False
        return keys


def split_quota(quota: int, sizes: np.ndarray) -> np.ndarray:
    """`quota` split over strata in proportion to `sizes` (integer largest remainder; ties to the lower index)."""
    total = int(sizes.sum())
    if total == 0 or quota == 0:
        return np.zeros(sizes.shape[0], dtype=np.int64)
    base, remainder = np.divmod(quota * sizes, total)  # [B] exact: integers only
    extra = quota - int(base.sum())
    order = np.lexsort((np.arange(sizes.shape[0]), -remainder))  # largest remainder first
    base[order[:extra]] += 1
    return base
