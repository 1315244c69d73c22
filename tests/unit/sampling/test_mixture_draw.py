"""What a mixture's epoch draws: floor or ceil of quota over size per sample, extras rotating, cost of the draws alone.

The promises are written in docs/mixtures.md ("How often each sample is drawn").
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from image_edit_data.sampling.keyed_shuffle import EXACT_UP_TO, KeyedShuffle
from image_edit_data.sampling.mixture_draw import Mixture
from image_edit_data.sampling.sampler import BucketBatchSampler
from image_edit_data.sampling.stratum_draw import Rotation

# Per source, its sizes in each bucket (a source has at least one sample).
source_buckets = st.lists(st.lists(st.integers(0, 30), min_size=3, max_size=3).filter(any), min_size=1, max_size=3)


def members_of(sizes: list[list[int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per bucket, ascending ids with sources end to end; and each source's first id (then the total)."""
    offsets = np.concatenate([[0], np.cumsum([sum(buckets) for buckets in sizes])])
    members: list[list[np.ndarray]] = [[] for _ in sizes[0]]
    for source, buckets in enumerate(sizes):
        start = offsets[source]
        for bucket, n in enumerate(buckets):
            members[bucket].append(np.arange(start, start + n))
            start += n
    return [np.concatenate(m) for m in members], offsets


def epoch_counts(mixture: Mixture, members: list[np.ndarray], seed: int, epoch: int) -> np.ndarray:
    """[total] how often epoch `epoch` draws each sample."""
    drawn = np.concatenate(mixture.epoch_members(members, seed, epoch))
    return np.bincount(drawn, minlength=sum(mixture.sizes))


@settings(max_examples=150, deadline=None)
@given(
    sizes=source_buckets,
    weights=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    samples_per_epoch=st.none() | st.integers(1, 300),
    first_epoch=st.integers(0, 40),
    seed=st.integers(0, 2**32),
)
@example(sizes=[[10, 0, 0]], weights=[1, 1, 1], samples_per_epoch=18, first_epoch=0, seed=42)  # 3 passes in epoch 1
@example(sizes=[[10, 0, 0]], weights=[1, 1, 1], samples_per_epoch=12, first_epoch=0, seed=42)  # 2 passes, 0 draws
def test_each_sample_of_a_source_is_drawn_floor_or_ceil_of_its_quota_over_its_size_in_every_epoch(
    sizes: list[list[int]], weights: list[int], samples_per_epoch: int | None, first_epoch: int, seed: int
) -> None:
    members, offsets = members_of(sizes)
    mixture = Mixture(tuple(sum(b) for b in sizes), tuple(float(w) for w in weights[: len(sizes)]), samples_per_epoch)
    for epoch in range(first_epoch, first_epoch + 3):
        counts = epoch_counts(mixture, members, seed, epoch)
        for source, quota in enumerate(mixture.quotas()):
            mine, n = counts[offsets[source] : offsets[source + 1]], mixture.sizes[source]
            assert mine.sum() == quota
            assert set(mine.tolist()) <= {quota // n, -(-quota // n)}, (epoch, source, quota, n, mine)


def assert_extras_rotate(n: int, quota: int, seed: int, epochs: int) -> None:
    """Each epoch draws each sample floor or ceil of quota/n times, and the running totals never differ by two."""
    mixture = Mixture((n,), (1.0,), samples_per_epoch=quota)
    members = [np.arange(n)]
    total = np.zeros(n, dtype=np.int64)
    ceils = []  # [epochs, n] whether each sample got its ceil
    for epoch in range(epochs):
        counts = epoch_counts(mixture, members, seed, epoch)
        assert set(counts.tolist()) <= {quota // n, -(-quota // n)}, (epoch, counts)
        total += counts
        assert total.max() - total.min() <= 1, f"epoch {epoch}: a sample got its ceil twice before another had it"
        ceils.append(counts > quota // n)
    extra = quota % n
    span = -(-2 * n // extra) if extra else epochs + 1  # every sample gets its ceil in any `span` consecutive epochs
    if span <= epochs:
        got = np.cumsum(np.array([np.zeros(n, dtype=bool), *ceils]), axis=0)  # [epochs + 1, n] ceils so far
        assert (got[span:] - got[:-span] >= 1).all()


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 60), quota=st.integers(1, 200), seed=st.integers(0, 2**32), epochs=st.integers(1, 40))
@example(n=10, quota=18, seed=42, epochs=4)
def test_counting_from_epoch_0_no_sample_gets_its_ceil_again_before_every_sample_has_had_it(
    n: int, quota: int, seed: int, epochs: int
) -> None:
    assert_extras_rotate(n, quota, seed, epochs)


@pytest.mark.parametrize(
    ("n", "quota", "epochs"),
    [(20011, 2 * 20011 + 10005, 9), (20011, 20011 - 6001, 9), (20011, 997, 45), (36011, 36011 + 18000, 6)],
    ids=["extras-half", "omissions", "few-extras", "extras-just-under-half"],
)
def test_large_strata_rotate_their_extras_through_keyed_orders(n: int, quota: int, epochs: int) -> None:
    assert n > EXACT_UP_TO
    assert_extras_rotate(n, quota, seed=7, epochs=epochs)


@pytest.mark.parametrize(("n", "k"), [(10, 3), (10, 5), (7, 2), (20, 9), (20011, 6007)])
def test_windows_go_through_passes_each_a_fresh_order_of_all_members(n: int, k: int) -> None:
    rotation = Rotation(n, k, key=(42, 0, 0))
    passes = np.concatenate([rotation.window(epoch) for epoch in range(4 * n // k + 1)])[: 4 * n].reshape(4, n)
    for order in passes:
        assert sorted(order.tolist()) == list(range(n)), "each pass holds every member once"
    assert len({tuple(order) for order in passes}) == 4, "each pass in another order"
    with pytest.raises(ValueError, match=r"a rotation needs 0 < 2k <= n, got k=6, n=10"):
        Rotation(10, 6, key=(1,))


@pytest.mark.parametrize("n", [1, 2, 7, EXACT_UP_TO, EXACT_UP_TO + 1, 100_003])
def test_a_keyed_shuffle_is_a_permutation_read_at_positions_and_inverted_by_position_of(n: int) -> None:
    shuffle = KeyedShuffle(n, (3, 1, 4))
    order = shuffle.at(np.arange(n))
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(shuffle.position_of(order), np.arange(n))
    assert np.array_equal(shuffle.at(np.array([n - 1, 0])), order[[n - 1, 0]]), "any positions, in any order"
    if n > 2:
        assert not np.array_equal(KeyedShuffle(n, (3, 1, 5)).at(np.arange(n)), order), "another key, another order"


def test_planning_an_epoch_of_a_subsampled_source_costs_memory_in_proportion_to_its_draws_not_its_size() -> None:
    huge = 4_000_000
    members = [np.arange(huge + 500, dtype=np.int32)]  # one bucket: a huge source, then a small one
    mixture = Mixture((huge, 500), (1.0, 1.0), samples_per_epoch=2000)  # 1000 draws each
    sampler = BucketBatchSampler(bucket_members=members, batch_sizes=[4], mixture=mixture)
    sampler.set_epoch(3)
    tracemalloc.start()
    try:
        plan = sampler.plan()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(plan) == 500
    assert peak < 1_000_000, f"planning took {peak:,} bytes for 2000 draws (the source's ids alone are 16 MB)"
