"""Exact resume of the standalone loader (`ImageEditDataloaderConfig.build()`) at every cut point.

A user's loop: `for epoch in range(start, n): sampler.set_epoch(epoch); for batch in loader: ...`,
saving `loader.state_dict()` somewhere in it. On restart: a fresh loader, `load_state_dict(state)`,
then the same loop from the checkpointed epoch. The batches before the cut plus those after the
resume must equal an uninterrupted run, and the two epochs after it must be intact.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
from support.caches import tiny_cache
from support.loader_cuts import BATCH, PATTERNS, PREFETCH, flat, ids, restored_as, resume, run_until_cut

from image_edit_data import ImageEditDataloaderConfig, ResumeMismatchError
from image_edit_data.sampling.resume import sampler_state_of

# (17, 15, 12) samples in batches of 2: 21 batches per epoch on one rank, 10 per rank on two.
COUNTS = (17, 15, 12)
# Cut points, as batches of the epoch taken before the state is saved. The prefetch window with
# 2 workers is 4 batches: 3 lies inside it, 5 just past it.
CUTS = ("after_1", "inside_prefetch", "past_prefetch", "mid", "one_before_end", "after_last", "loop_ended")
# (world size, epoch of the cut): one rank in the first epoch, two in a later one. The two act on separate
# parts of the state (the rank's share of the plan; the epoch it restores), so pairing them keeps each at
# every cut and worker count for half the loaders started.
WORLD_EPOCH = [(1, 0), (2, 1)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=COUNTS)


def config(cache_dir: Path, num_workers: int) -> ImageEditDataloaderConfig:
    return ImageEditDataloaderConfig(cache_dir=str(cache_dir), num_workers=num_workers, prefetch_factor=PREFETCH)


@cache
def baseline(cache_dir: Path, rank: int, world: int, epochs: int = 5) -> tuple[list[list[int]], ...]:
    """Each epoch's batches of one uninterrupted run (in-process; workers give the same batches)."""
    built = config(cache_dir, 0).build(dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    out = []
    for epoch in range(epochs):
        built.sampler.set_epoch(epoch)
        out.append([ids(b) for b in built.dataloader])
    return tuple(out)


# How a training loop restores: the loader's state (our README), the sampler's alone, or NeMo Automodel's
# recipe, which saves every stateful object it tracks and loads the loader's state, then the sampler's.


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize(("world", "epoch"), WORLD_EPOCH)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_exactly_at_every_cut_point_whichever_state_is_restored(
    cache_dir: Path, num_workers: int, world: int, epoch: int, cut: str
) -> None:
    cfg = config(cache_dir, num_workers)
    for rank in range(world):
        expected = baseline(cache_dir, rank, world)
        seen, state = run_until_cut(cfg, rank, world, epoch, cut)
        for pattern in PATTERNS:
            rest = resume(cfg, rank, world, restored_as(state, pattern), range(epoch, epoch + 3))
            assert seen + rest == flat(expected, epoch, epoch + 2), f"rank {rank}, restoring {pattern}"


@pytest.mark.parametrize("then_next_epoch", [False, True])
@pytest.mark.parametrize(("world", "epoch"), WORLD_EPOCH)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_after_the_epoch_loop_resumes_into_the_next_epoch_fresh(
    cache_dir: Path, num_workers: int, world: int, epoch: int, then_next_epoch: bool
) -> None:
    """The loop resumes after the saved epoch, whether or not `set_epoch(epoch + 1)` came before the save."""
    cfg = config(cache_dir, num_workers)
    for rank in range(world):
        expected = baseline(cache_dir, rank, world)
        seen, state = run_until_cut(cfg, rank, world, epoch, "loop_ended", then_next_epoch=then_next_epoch)
        assert seen == expected[epoch]
        for pattern in PATTERNS:
            rest = resume(cfg, rank, world, restored_as(state, pattern), range(epoch + 1, epoch + 3))
            assert rest == flat(expected, epoch + 1, epoch + 2), f"rank {rank}, restoring {pattern}"


@pytest.mark.parametrize("cut", ["mid", "after_last", "loop_ended"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_before_load_state_dict_means_the_same(cache_dir: Path, num_workers: int, cut: str) -> None:
    cfg = config(cache_dir, num_workers)
    expected = baseline(cache_dir, 0, 1)
    seen, state = run_until_cut(cfg, 0, 1, 1, cut)
    rest = resume(cfg, 0, 1, restored_as(state, "loader"), range(1, 4), set_first=True)
    assert seen + rest == flat(expected, 1, 3)


@pytest.mark.parametrize("cut", ["inside_prefetch", "mid", "after_last", "loop_ended"])
@pytest.mark.parametrize(("saved_with", "resumed_with"), [(0, 2), (2, 0), (2, 3)])
def test_num_workers_may_change_across_a_resume(cache_dir: Path, saved_with: int, resumed_with: int, cut: str) -> None:
    expected = baseline(cache_dir, 1, 2)
    seen, state = run_until_cut(config(cache_dir, saved_with), 1, 2, 1, cut)
    rest = resume(config(cache_dir, resumed_with), 1, 2, restored_as(state, "loader"), range(1, 4))
    assert seen + rest == flat(expected, 1, 3)


def test_without_set_epoch_a_state_at_an_epochs_end_finishes_that_epoch_then_moves_on(cache_dir: Path) -> None:
    cfg = config(cache_dir, 0)
    expected = baseline(cache_dir, 0, 1)
    _, state = run_until_cut(cfg, 0, 1, 0, "after_last")
    built = cfg.build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    built.dataloader.load_state_dict(state["loader"])
    passes = [[ids(b) for b in built.dataloader] for _ in range(3)]
    assert passes == [[], expected[1], expected[2]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_samplers_state_counts_only_batches_consumed_and_equals_the_loaders(
    cache_dir: Path, num_workers: int
) -> None:
    """Workers run up to num_workers x prefetch_factor batches ahead; neither state counts those."""
    cfg = config(cache_dir, num_workers)
    built = cfg.build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    built.sampler.set_epoch(0)
    iterator = iter(built.dataloader)
    trained = [ids(next(iterator)) for _ in range(6)]
    sampler_state, loader_state = built.sampler.state_dict(), built.dataloader.state_dict()
    del iterator
    assert sampler_state["consumed"] == len(trained)
    assert sampler_state == sampler_state_of(loader_state)
    rest = resume(cfg, 0, 1, {"sampler": sampler_state}, range(0, 1))
    assert trained + rest == baseline(cache_dir, 0, 1)[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_broken_off_continues_at_the_first_batch_not_consumed(cache_dir: Path, num_workers: int) -> None:
    """Batches prefetched by an abandoned pass come again in the next pass of the same epoch."""
    built = config(cache_dir, num_workers).build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    for _ in range(2):
        built.sampler.set_epoch(0)
        first = []
        for batch in built.dataloader:
            first.append(ids(batch))
            if len(first) == 3:
                break
        built.sampler.set_epoch(0)
        rest = [ids(b) for b in built.dataloader]
        assert first + rest == baseline(cache_dir, 0, 1)[0]
        built.sampler.set_epoch(1)  # the second round: the same with the pool reused, from a fresh epoch
        assert [ids(b) for b in built.dataloader] == baseline(cache_dir, 0, 1)[1]
        built.sampler.advance_epoch(0)


def test_a_pass_with_workers_builds_no_loader_state_per_batch(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = config(cache_dir, 2).build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    built.sampler.set_epoch(0)
    built_states: list[int] = []
    state_dict = built.sampler.state_dict

    def counted() -> dict[str, Any]:
        built_states.append(1)
        return state_dict()

    monkeypatch.setattr(built.sampler, "state_dict", counted)
    assert [ids(b) for b in built.dataloader] == baseline(cache_dir, 0, 1)[0]
    # torchdata would build the sampler's state for every batch it hands a worker (21 here); nothing reads it.
    assert len(built_states) <= 1  # at most once as the pass starts
    built.dataloader.close()


@pytest.mark.parametrize("saved_with_workers", [False, True])
def test_a_loader_state_in_torchdatas_form_still_resumes(cache_dir: Path, saved_with_workers: bool) -> None:
    """Loaders before 0.2 saved torchdata's own state; its sampler snapshot is the consumed position."""
    cfg = config(cache_dir, 0)
    seen, state = run_until_cut(cfg, 0, 1, 1, "mid")
    sampler_state = state["sampler"]
    if saved_with_workers:
        old = {"_snapshot": {"_main_snapshot": {"_index_sampler_state": sampler_state}}, "_steps_since_snapshot": 0}
    else:
        old = {"_index_sampler_state": sampler_state, "_num_yielded": sampler_state["consumed"]}
    rest = resume(cfg, 0, 1, {"loader": old}, range(1, 3))
    assert seen + rest == flat(baseline(cache_dir, 0, 1), 1, 2)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"something": 1}, r"not the state_dict\(\) of an image-edit-data loader .*something"),
        ({"_snapshot": {}, "_steps_since_snapshot": 2}, "saved between torchdata snapshots"),
        ({"_index_sampler_state": {"epoch": 0}}, "not an image-edit-data sampler state"),
        ([1, 2], "a loader state is a dict, got list"),
    ],
)
def test_a_foreign_loader_state_is_refused_clearly(cache_dir: Path, state: Any, message: str) -> None:
    built = config(cache_dir, 0).build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    with pytest.raises(ResumeMismatchError, match=message):
        built.dataloader.load_state_dict(state)


def test_a_loader_state_from_another_world_size_is_refused(cache_dir: Path) -> None:
    _, state = run_until_cut(config(cache_dir, 2), 0, 2, 0, "mid")
    built = config(cache_dir, 0).build(dp_rank=0, dp_world_size=1, batch_size=BATCH)
    with pytest.raises(ResumeMismatchError, match="world_size: checkpoint 2, now 1"):
        built.dataloader.load_state_dict(state["loader"])
