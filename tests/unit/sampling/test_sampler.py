"""Sampler invariants over many bucket sizes, world sizes and batch sizes."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from image_edit_data.sampling.sampler import BucketBatchSampler, EvalBatchSampler, ResumeMismatchError

bucket_sizes = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=5)


def members_for(sizes: list[int]) -> list[np.ndarray]:
    """Bucket b holds consecutive ids; the bucket of sample i is recoverable from `owner`."""
    starts = np.cumsum([0, *sizes])
    return [np.arange(starts[b], starts[b + 1]) for b in range(len(sizes))]


def ranks(sizes: list[int], world: int, batch: int, **kwargs: object) -> list[BucketBatchSampler]:
    return [
        BucketBatchSampler(
            bucket_members=members_for(sizes), batch_sizes=[batch] * len(sizes), rank=r, world_size=world, **kwargs
        )
        for r in range(world)
    ]


def owner(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


@settings(max_examples=150, deadline=None)
@given(
    bucket_sizes,
    st.integers(1, 5),
    st.integers(1, 6),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["interleaved", "sequential"]),
)
def test_every_rank_gets_the_same_number_of_single_bucket_batches(
    sizes: list[int], world: int, batch: int, drop_last: bool, shuffle: bool, order: str
) -> None:
    samplers = ranks(sizes, world, batch, drop_last=drop_last, shuffle=shuffle, bucket_order=order, seed=3)
    epochs = [list(s) for s in samplers]
    assert len({len(e) for e in epochs}) == 1
    assert all(len(e) == len(s) for e, s in zip(epochs, samplers))
    bucket_of = owner(sizes)
    for step in range(len(epochs[0])):
        buckets = {int(bucket_of[i]) for e in epochs for i in e[step]}
        assert len(buckets) == 1, "all ranks run one bucket at each step"
        assert len({len(e[step]) for e in epochs}) == 1
        assert all(len(e[step]) == batch for e in epochs) or not drop_last


@settings(max_examples=150, deadline=None)
@given(bucket_sizes, st.integers(1, 5), st.integers(1, 6), st.booleans())
def test_without_drop_last_every_sample_is_seen_and_only_padding_repeats(
    sizes: list[int], world: int, batch: int, shuffle: bool
) -> None:
    seen = Counter(i for s in ranks(sizes, world, batch, drop_last=False, shuffle=shuffle) for b in s for i in b)
    assert set(seen) == set(range(sum(sizes)))
    repeats = sum(seen.values()) - sum(sizes)
    padding = sum(-(-n // world) * world - n for n in sizes)  # rank padding per bucket
    assert repeats == padding


@settings(max_examples=100, deadline=None)
@given(bucket_sizes, st.integers(1, 5), st.integers(1, 6))
def test_with_drop_last_batches_are_full_and_no_sample_appears_twice_beyond_padding(
    sizes: list[int], world: int, batch: int
) -> None:
    samplers = ranks(sizes, world, batch, drop_last=True)
    all_batches = [b for s in samplers for b in s]
    assert all(len(b) == batch for b in all_batches)
    seen = Counter(i for b in all_batches for i in b)
    for bucket, n in enumerate(sizes):
        per_rank = -(-n // world)
        expected_max = -(-per_rank * world // max(n, 1)) if n else 0
        assert all(seen[i] <= expected_max for i in members_for(sizes)[bucket])


def test_order_is_deterministic_from_seed_and_epoch() -> None:
    def order(seed: int, epoch: int) -> list[list[int]]:
        (s,) = ranks([30, 20], 1, 4, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(2, 0)
    assert order(1, 0) != order(1, 1)


def test_sequential_order_walks_buckets_one_after_another() -> None:
    (s,) = ranks([8, 8, 8], 1, 4, bucket_order="sequential")
    buckets = [int(owner([8, 8, 8])[b[0]]) for b in s]
    assert buckets == [0, 0, 1, 1, 2, 2]


def test_interleaved_order_mixes_buckets() -> None:
    (s,) = ranks([40, 40, 40], 1, 2)
    buckets = [int(owner([40] * 3)[b[0]]) for b in s]
    switches = sum(a != b for a, b in pairwise(buckets))
    assert switches > 20


def test_an_epoch_that_ran_to_its_end_rolls_over_without_set_epoch() -> None:
    (s,) = ranks([10], 1, 2)
    first, second = list(s), list(s)
    assert s.epoch == 1 and first != second
    s.set_epoch(0)
    assert list(s) == first


def test_set_epoch_keeps_a_restored_position_in_the_same_epoch() -> None:
    (s,) = ranks([20], 1, 2)
    s.set_epoch(3)
    full = list(s)
    (t,) = ranks([20], 1, 2)
    t.load_state_dict({**s.state_dict(), "epoch": 3, "consumed": 4})
    t.set_epoch(3)
    assert list(t) == full[4:]


def test_state_dict_is_a_fresh_dict_each_time() -> None:
    (s,) = ranks([20], 1, 2)
    it = iter(s)
    state = s.state_dict()
    next(it)
    assert state["consumed"] == 0 and s.state_dict()["consumed"] == 1


def test_a_finished_epoch_loaded_continues_empty_with_its_own_epoch_and_fresh_with_the_next() -> None:
    (s,) = ranks([8], 1, 2)
    s.set_epoch(1)
    second_epoch = list(s)
    finished = s.state_dict() | {"epoch": 0, "consumed": 4}
    (t,) = ranks([8], 1, 2)
    t.load_state_dict(finished)
    t.set_epoch(0)
    assert list(t) == []
    t.set_epoch(1)
    assert list(t) == second_epoch
    (u,) = ranks([8], 1, 2)
    u.load_state_dict(finished)
    assert [list(u), list(u)] == [[], second_epoch]  # no set_epoch: the rest of epoch 0, then epoch 1


def test_set_epoch_named_before_load_state_dict_is_honoured() -> None:
    (s,) = ranks([20], 1, 2)
    s.set_epoch(2)
    full = list(s)
    state = s.state_dict() | {"epoch": 2, "consumed": 3}
    (t,) = ranks([20], 1, 2)
    t.set_epoch(2)
    t.load_state_dict(state)
    assert list(t) == full[3:]
    (u,) = ranks([20], 1, 2)
    u.set_epoch(3)
    u.load_state_dict(state)
    assert u.epoch == 3 and u.consumed == 0


def test_a_set_epoch_older_than_the_last_iteration_does_not_override_a_loaded_state() -> None:
    (s,) = ranks([20], 1, 2)
    s.set_epoch(5)
    next(iter(s))
    s.load_state_dict(s.state_dict() | {"epoch": 2, "consumed": 3})
    assert (s.epoch, s.consumed) == (2, 3)


def test_changed_config_is_refused_naming_each_change() -> None:
    (s,) = ranks([8], 1, 2, seed=42)
    (t,) = ranks([8], 1, 4, seed=7)
    with pytest.raises(
        ResumeMismatchError, match=r"batch_sizes: checkpoint \[2\], now \[4\]; seed: checkpoint 42, now 7"
    ):
        t.load_state_dict(s.state_dict())


def test_changed_world_size_needs_elastic() -> None:
    (s,) = ranks([8], 1, 2)
    two = ranks([8], 2, 2)
    with pytest.raises(ResumeMismatchError, match="world_size: checkpoint 1, now 2.*elastic=True"):
        two[0].load_state_dict(s.state_dict())


@pytest.mark.parametrize("version", [0, 2, None])
def test_unknown_state_versions_are_refused(version: object) -> None:
    (s,) = ranks([8], 1, 2)
    with pytest.raises(ResumeMismatchError, match="version"):
        s.load_state_dict(s.state_dict() | {"version": version})


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0)])
def test_bad_rank_or_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="dp_"):
        BucketBatchSampler(bucket_members=[np.arange(4)], batch_sizes=[2], rank=rank, world_size=world)


@settings(max_examples=60, deadline=None)
@given(
    bucket_sizes,
    st.lists(st.integers(1, 4), min_size=2, max_size=4),
    st.integers(1, 4),
    st.data(),
    st.booleans(),
)
def test_elastic_resume_covers_each_remaining_sample_exactly_once(
    sizes: list[int], worlds: list[int], batch: int, data: st.DataObject, drop_last: bool
) -> None:
    trained: Counter[int] = Counter()
    state = None
    due = set()
    for segment, world in enumerate(worlds):
        samplers = ranks(sizes, world, batch, drop_last=drop_last, elastic=True)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        if segment == 0:
            due = {i for s in ranks(sizes, world, batch, drop_last=drop_last) for b in s for i in b}
        if samplers[0].epoch != 0:
            break  # the saved position was the end of the epoch
        length = len(samplers[0])
        last = segment == len(worlds) - 1
        remaining = length - samplers[0].consumed
        cut = remaining if last else data.draw(st.integers(0, remaining))
        iters = [iter(s) for s in samplers]
        for _ in range(cut):
            for it in iters:
                trained.update(next(it))
        state = samplers[0].state_dict()
    assert set(trained) == due, "every sample due in the epoch is trained on, and nothing else"


def test_evaluation_sampler_gives_each_sample_once_without_padding() -> None:
    sizes = [5, 3, 7]
    samplers = [
        EvalBatchSampler(bucket_members=members_for(sizes), batch_sizes=[2] * 3, rank=r, world_size=2) for r in range(2)
    ]
    seen = Counter(i for s in samplers for b in s for i in b)
    assert seen == Counter(range(15))
    assert [len(s) for s in samplers] == [5, 4]


def test_max_batches_truncates_the_epoch() -> None:
    (s,) = ranks([40], 1, 2, max_batches=3)
    assert len(s) == 3 and len(list(s)) == 3


@settings(max_examples=100, deadline=None)
@given(bucket_sizes, st.integers(1, 5), st.integers(1, 6), st.booleans())
def test_steady_length_counts_a_fresh_epoch_by_arithmetic(sizes: list[int], world: int, batch: int, drop: bool) -> None:
    (s, *_) = ranks(sizes, world, batch, drop_last=drop)
    assert s.steady_length() == len(s) == len(list(s))
