"""Mixtures of caches: the epoch draw by weight, repeats, the pure plan, compatibility checks and exact resume.

The plan-level claims run on bucket member arrays alone (no cache); the loader-level ones on tiny
caches built with `cachefactory`, resumed with the standalone loader's harness (`test_loader_resume`).
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.caches import make_payload, tiny_cache, write_cache
from support.loader_cuts import BATCH, PATTERNS, flat, restored_as, resume, run_until_cut

from image_edit_data import CacheSource, ImageEditDataloaderConfig, MixtureDataset, ResumeMismatchError
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.sampling.mixture_draw import DRAW_VERSION, Mixture
from image_edit_data.sampling.resume import restore
from image_edit_data.sampling.sampler import BucketBatchSampler

# Three sources over three buckets, as an edit set, a small in-house edit set and a text-to-image set
# (its own bucket: a sample without context never shares one with an edit). Sizes are per bucket.
SOURCE_BUCKETS = ((1400, 500, 0), (90, 40, 0), (0, 0, 260))
WEIGHTS = (3.0, 1.0, 1.0)


def members_of(source_buckets: tuple[tuple[int, ...], ...]) -> tuple[list[np.ndarray], np.ndarray]:
    """Per bucket, ascending ids with sources end to end; and each source's first id (then the total)."""
    sizes = [sum(buckets) for buckets in source_buckets]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    members: list[list[np.ndarray]] = [[] for _ in source_buckets[0]]
    for source, buckets in enumerate(source_buckets):
        start = offsets[source]
        for bucket, n in enumerate(buckets):
            members[bucket].append(np.arange(start, start + n))
            start += n
    return [np.concatenate(m) for m in members], offsets


def mixture_samplers(world: int, batch_sizes: list[int], **kwargs: Any) -> tuple[list[BucketBatchSampler], Mixture]:
    members, offsets = members_of(SOURCE_BUCKETS)
    mixture = Mixture(tuple(int(n) for n in np.diff(offsets)), WEIGHTS, **kwargs)
    samplers = [
        BucketBatchSampler(bucket_members=members, batch_sizes=batch_sizes, rank=r, world_size=world, mixture=mixture)
        for r in range(world)
    ]
    return samplers, mixture


def test_quotas_split_the_epoch_by_weight_to_within_one_sample() -> None:
    mixture = Mixture((1900, 130, 260), WEIGHTS)
    quotas = mixture.quotas()
    assert sum(quotas) == mixture.epoch_samples == 2290
    for quota, target in zip(quotas, mixture.targets):
        assert abs(quota - 2290 * target) < 1
    assert Mixture((10, 10), (1.0, 1.0), samples_per_epoch=7).quotas() in ([4, 3], [3, 4])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch_sizes", [[4, 4, 4], [2, 5, 8]], ids=["fixed", "dynamic"])
def test_each_sources_share_of_an_epoch_is_within_one_percent_of_its_weight(world: int, batch_sizes: list[int]) -> None:
    samplers, mixture = mixture_samplers(world, batch_sizes)
    offsets = mixture.offsets
    for epoch in range(3):
        trained: Counter[int] = Counter()
        for sampler in samplers:
            sampler.set_epoch(epoch)
            for batch in sampler:
                trained.update(np.searchsorted(offsets, batch, side="right") - 1)
        total = sum(trained.values())
        one_batch = max(batch_sizes) * world / total
        for source, target in enumerate(mixture.targets):
            assert abs(trained[source] / total - target) <= max(0.01, one_batch), (epoch, source, trained)


def test_a_source_smaller_than_its_share_repeats_and_a_larger_one_is_drawn_through_over_epochs() -> None:
    members, _ = members_of(((10, 0, 0), (90, 0, 0)))
    mixture = Mixture((10, 90), (1.0, 1.0))  # 100 samples per epoch, 50 each
    sampler = BucketBatchSampler(bucket_members=members[:1], batch_sizes=[5], mixture=mixture)
    seen: list[Counter[int]] = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen.append(Counter(i for batch in sampler for i in batch))
        assert all(seen[-1][i] == 5 for i in range(10)), "each small-source sample five times per epoch"
        assert sum(seen[-1][i] for i in range(10, 100)) == 50
    assert max(seen[0][i] for i in range(10, 100)) == 1, "epoch 0 lies inside the large source's first pass"
    both = seen[0] + seen[1]
    assert all(1 <= both[i] <= 2 for i in range(10, 100)), "two epochs go through the large source once"


def test_the_plan_is_a_pure_function_of_its_inputs_that_each_rank_computes_alone() -> None:
    def batches(seed: int) -> list[list[list[int]]]:
        samplers, _ = mixture_samplers(2, [4, 4, 4])
        for s in samplers:
            s.seed = seed
            s.set_epoch(1)
        return [[list(b) for b in s] for s in samplers]

    first, again = batches(42), batches(42)
    assert first == again
    assert batches(7) != first
    samplers, _ = mixture_samplers(2, [4, 4, 4])
    for s in samplers:
        s.set_epoch(1)
    plan = samplers[0].plan()
    assert len(first[0]) == len(first[1]) == samplers[0].steady_length() == len(plan)
    members, _ = members_of(SOURCE_BUCKETS)
    bucket_of = {int(i): b for b, m in enumerate(members) for i in m}
    for step, (a, b) in enumerate(zip(*first)):
        assert {bucket_of[i] for i in a + b} == {int(plan.bucket[step])}, "ranks share one bucket per step"


def test_a_one_source_mixture_plans_and_fingerprints_exactly_like_its_cache_alone(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(7, 6, 5))
    alone = ImageEditDataloaderConfig(cache_dir=str(cache), num_workers=0).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    config = ImageEditDataloaderConfig(sources=[CacheSource(str(cache), weight=2.0)], num_workers=0)
    mixed = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    for epoch in range(2):
        alone.sampler.set_epoch(epoch)
        mixed.sampler.set_epoch(epoch)
        assert [list(b) for b in alone.sampler] == [list(b) for b in mixed.sampler]
    assert alone.sampler.fingerprint() == mixed.sampler.fingerprint()


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Three compatible caches: two edit caches sharing shapes, and one of other shapes."""
    root = tmp_path_factory.mktemp("mixture")
    large = tiny_cache(root / "large", counts=(14, 10, 6))
    small = tiny_cache(root / "small", counts=(3, 2, 2))
    other = ((4, 4, 8), ((4, 4, 8),))
    third = tiny_cache(root / "third", counts=(9,), buckets=(other,))
    return large, small, third


def sources_of(caches: tuple[Path, Path, Path]) -> list[dict[str, Any]]:
    return [{"cache_dir": str(c), "weight": w} for c, w in zip(caches, WEIGHTS)]


def mixture_config(caches: tuple[Path, Path, Path], workers: int = 0, **options: Any) -> ImageEditDataloaderConfig:
    return ImageEditDataloaderConfig(sources=sources_of(caches), num_workers=workers, prefetch_factor=2, **options)


def test_batches_name_each_samples_source_and_keep_one_signature_with_dynamic_batch_sizes(
    caches: tuple[Path, Path, Path],
) -> None:
    config = mixture_config(caches, dynamic_batch_size=True, base_resolution=(96, 96), quantization=32)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    dataset = built.dataloader.dataset
    assert isinstance(dataset, MixtureDataset)
    assert dataset.names == ["large", "small", "third"]
    budget = 2 * 2 * 3 * 3  # batch_size x (target + one context) x quantized cells at the base resolution
    sizes_seen = set()
    for batch in built.dataloader:
        metadata = batch["metadata"]
        owners = [dataset.names[dataset.locate(i)[0]] for i in metadata["sample_indices"]]
        assert metadata["sources"] == owners
        cells = sum(
            -(-h * 8 // 32) * -(-w * 8 // 32)
            for h, w in [batch["image_latents"].shape[2:], *(c.shape[2:] for c in batch["context_latents"])]
        )
        assert len(owners) * cells <= budget, "every batch fits the one token budget"
        for i, index in enumerate(metadata["sample_indices"]):
            source, local = dataset.locate(index)
            assert torch.equal(batch["image_latents"][i], dataset.sources[source][local]["target_latent"])
        sizes_seen.add(len(owners))
    assert len(sizes_seen) > 1, "buckets of different shapes get different batch sizes"


def test_each_source_reads_its_own_cache_and_index(caches: tuple[Path, Path, Path]) -> None:
    dataset = mixture_config(caches).open_dataset()
    assert isinstance(dataset, MixtureDataset)
    assert dataset.sizes == (30, 7, 9) and len(dataset) == 46
    assert dataset.locate(30) == (1, 0) and dataset.locate(45) == (2, 8)
    assert torch.equal(dataset[31]["target_latent"], dataset.sources[1][1]["target_latent"])
    assert dataset[31]["sample_index"] == 31


def incompatible(root: Path, **payload: Any) -> Path:
    return write_cache(root, [make_payload(i, **payload) for i in range(4)])


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"hidden": 8}, r"prompt embedding width: 6 vs 8"),
        ({"target": (8, 8, 8), "contexts": ((8, 8, 8),)}, r"latent channels: \[4\] vs \[8\]"),
        ({"conditioning": {"pooled": torch.zeros(3)}}, r"conditioning tensors: \[\] vs \['pooled'\]"),
    ],
    ids=["prompt-width", "latent-channels", "conditioning-keys"],
)
def test_sources_that_cannot_share_a_batch_are_refused_naming_both_and_the_field(
    caches: tuple[Path, Path, Path], tmp_path: Path, payload: dict[str, Any], field: str
) -> None:
    odd = incompatible(tmp_path / "odd", **payload)
    sources = [{"cache_dir": str(caches[0])}, {"cache_dir": str(caches[1])}, {"cache_dir": str(odd), "name": "odd"}]
    config = ImageEditDataloaderConfig(sources=sources, num_workers=0)
    message = rf"sources\[0\] 'large' \(.*large\) and sources\[2\] 'odd' \(.*odd\) cannot share batches: {field}"
    with pytest.raises(ValueError, match=message):
        config.open_dataset()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cache_dir": "x", "sources": [{"cache_dir": "y"}]}, "set either cache_dir .* or sources"),
        ({}, "set either cache_dir .* or sources"),
        ({"sources": []}, "sources: expected a non-empty list"),
        ({"sources": [{"cache_dir": "a", "weight": 0}]}, r"sources\[0\].weight: expected a positive number, got 0"),
        ({"sources": [{"cache_dir": "a", "weight": True}]}, r"sources\[0\].weight: expected a positive number"),
        ({"sources": [{"cache_dir": "a", "wieght": 2}]}, r"sources\[0\]: unknown option 'wieght'"),
        ({"sources": [{"weight": 2}]}, r"sources\[0\]: cache_dir is missing"),
        ({"sources": [{"cache_dir": "x/a"}, {"cache_dir": "y/a"}]}, r"sources\[0\] and sources\[1\] are both named"),
        ({"cache_dir": "a", "samples_per_epoch": 0}, "samples_per_epoch must be a positive integer, got 0"),
    ],
)
def test_a_malformed_mixture_is_refused_naming_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageEditDataloaderConfig(**options)


def test_samples_per_epoch_sets_the_epoch_length_shared_out_by_weight(caches: tuple[Path, Path, Path]) -> None:
    built = mixture_config(caches, samples_per_epoch=100, drop_last=False).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    dataset = built.dataloader.dataset
    counts = Counter(dataset.locate(i)[0] for batch in built.sampler for i in batch)
    assert counts == {0: 60, 1: 20, 2: 20}
    assert built.sampler.fingerprint()["samples_per_epoch"] == 100


# Exact resume of the standalone loader over a mixture: the single-cache harness with a mixture config.


@cache
def mixture_baseline(caches: tuple[Path, Path, Path], rank: int, world: int, epochs: int = 4) -> list[list[list[int]]]:
    built = mixture_config(caches).build(dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    out = []
    for epoch in range(epochs):
        built.sampler.set_epoch(epoch)
        out.append([b["metadata"]["sample_indices"] for b in built.dataloader])
    return out


@pytest.mark.parametrize(
    ("workers", "world", "epoch", "cut"),
    [
        (0, 1, 0, "mid"),
        (0, 2, 1, "inside_prefetch"),
        (0, 1, 1, "after_last"),
        (0, 2, 0, "loop_ended"),
        (2, 2, 1, "past_prefetch"),
    ],
)
def test_a_mixture_loader_resumes_exactly_at_a_cut_whichever_state_is_restored(
    caches: tuple[Path, Path, Path], workers: int, world: int, epoch: int, cut: str
) -> None:
    cfg = mixture_config(caches, workers)
    for rank in range(world):
        expected = mixture_baseline(caches, rank, world)
        seen, state = run_until_cut(cfg, rank, world, epoch, cut)
        for pattern in PATTERNS:
            rest = resume(cfg, rank, world, restored_as(state, pattern), range(epoch, epoch + 2))
            assert seen + rest == flat(tuple(expected), epoch, epoch + 1), f"rank {rank}, restoring {pattern}"


def test_a_mixture_resumed_elastically_on_fewer_ranks_trains_every_due_draw_once(
    caches: tuple[Path, Path, Path],
) -> None:
    cfg = mixture_config(caches, elastic=True)
    due = Counter(i for rank in range(2) for batch in mixture_baseline(caches, rank, 2)[1] for i in batch)
    before: Counter[int] = Counter()
    states = []
    for rank in range(2):
        seen, state = run_until_cut(cfg, rank, 2, 1, "mid")
        before.update(i for batch in seen for i in batch)
        states.append(state)
    assert states[0]["sampler"] == states[1]["sampler"]
    after = resume(cfg, 0, 1, restored_as(states[0], "loader"), range(1, 3))
    next_epoch = mixture_baseline(caches, 0, 1)[2]
    assert after[len(after) - len(next_epoch) :] == next_epoch, "the next epoch is planned normally"
    trained = before + Counter(i for batch in after[: len(after) - len(next_epoch)] for i in batch)
    assert set(trained) == set(due), "every sample due in the interrupted epoch is trained on, and no other"
    # Rank padding repeats a few draws at two ranks; the continuation pads its last batches at one.
    assert sum((due - trained).values()) <= 4 and sum((trained - due).values()) <= 4 * (BATCH - 1)


def saved_mid_epoch(caches: tuple[Path, Path, Path]) -> dict[str, Any]:
    return run_until_cut(mixture_config(caches), 0, 1, 0, "mid")[1]["sampler"]


def moved(sources: list[dict[str, Any]], frm: int, to: int, **changes: Any) -> None:
    sources.insert(to, {**sources.pop(frm), **changes})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s[1].update(weight=2.0), r"sources\[1\].weight \('small'\): checkpoint 1.0, now 2.0"),
        (lambda s: s.pop(), r"sources: checkpoint 3, now 2; sources\[2\] 'third' of the checkpoint is gone$"),
        (
            lambda s: s.pop(0),
            r"sources: checkpoint 3, now 2; sources\[0\] 'large' of the checkpoint is gone; "
            r"'small' moved from sources\[1\] to sources\[0\]; 'third' moved from sources\[2\] to sources\[1\]$",
        ),
        (
            lambda s: s.append({"cache_dir": s[0]["cache_dir"], "name": "again"}),
            r"sources: checkpoint 3, now 4; sources\[3\] 'again' is new$",
        ),
        (
            lambda s: s.reverse(),
            r"fit: 'third' moved from sources\[2\] to sources\[0\]; 'large' moved from sources\[0\] to sources\[2\]$",
        ),
        (
            lambda s: moved(s, 1, 0, name="in-house", weight=2.0),
            r"'in-house' \(checkpoint 'small'\) moved from sources\[1\] to sources\[0\]; "
            r"sources\[0\].weight \('in-house', checkpoint 'small'\): checkpoint 1.0, now 2.0; "
            r"'large' moved from sources\[0\] to sources\[1\]$",
        ),
    ],
    ids=["weight", "removed-last", "removed-first", "added", "reordered", "renamed-moved-reweighted"],
)
def test_a_changed_mixture_is_refused_naming_what_changed_or_restarts_the_epoch_when_asked(
    caches: tuple[Path, Path, Path], change: Any, message: str
) -> None:
    state = saved_mid_epoch(caches)
    sources = sources_of(caches)
    change(sources)
    built = ImageEditDataloaderConfig(sources=sources, num_workers=0).build(dp_rank=0, dp_world_size=1, batch_size=2)
    with pytest.raises(ResumeMismatchError, match=message):
        built.sampler.load_state_dict(state)
    why = restore(built.sampler, state, restart_on_mismatch=True)
    assert why is not None and (built.sampler.epoch, built.sampler.consumed) == (0, 0)


OLD_DRAW_STATE = Path(__file__).parents[2] / "data" / "mixture_draw_1" / "state.json"  # written by ee4b5e5


def test_a_mixture_checkpoint_of_the_previous_draw_is_refused_naming_the_draw_or_restarts_its_epoch(
    caches: tuple[Path, Path, Path],
) -> None:
    state = json.loads(OLD_DRAW_STATE.read_text())
    built = mixture_config(caches).build(dp_rank=0, dp_world_size=1, batch_size=2)
    message = (
        r"does not fit: mixture_draw: checkpoint 1, now 2 \(this image-edit-data draws a mixture's epochs otherwise "
        r"than the one that wrote the checkpoint .*, so the saved position would name other samples\)$"
    )
    with pytest.raises(ResumeMismatchError, match=message):
        built.dataloader.load_state_dict(state["loader"])
    with pytest.raises(ResumeMismatchError, match=message):
        built.sampler.load_state_dict(state["sampler"])
    why = restore(built.sampler, state["sampler"], restart_on_mismatch=True)
    assert why is not None and "mixture_draw" in why and (built.sampler.epoch, built.sampler.consumed) == (1, 0)
    state["sampler"]["fingerprint"]["mixture_draw"] = DRAW_VERSION
    built.sampler.load_state_dict(state["sampler"])
    assert (built.sampler.epoch, built.sampler.consumed) == (1, 10), "the draw is all that changed"


def test_a_renamed_source_resumes_and_a_mixtures_checkpoint_is_refused_by_a_single_cache(
    caches: tuple[Path, Path, Path],
) -> None:
    state = saved_mid_epoch(caches)
    sources = sources_of(caches)
    sources[1]["name"] = "in-house"
    built = ImageEditDataloaderConfig(sources=sources, num_workers=0).build(dp_rank=0, dp_world_size=1, batch_size=2)
    built.sampler.load_state_dict(state)
    assert built.sampler.consumed == state["consumed"]
    single = ImageEditDataloaderConfig(cache_dir=str(caches[0]), num_workers=0).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    with pytest.raises(ResumeMismatchError, match=r"sources: checkpoint 3, now 1"):
        single.sampler.load_state_dict(state)


def test_skipped_samples_of_a_source_are_reported_in_mixture_ids_and_quarantined_per_source(
    caches: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    small = tiny_cache(tmp_path / "small", counts=(3, 2, 2))
    for i in (0, 4):  # sample 0, the one a source's check would read first, and another
        (small / f"samples/sample_{i:08d}.pt").write_bytes(b"PK\x03\x04 truncated")
    quarantine = tmp_path / "q.jsonl"
    sources = [{"cache_dir": str(caches[0]), "weight": 3}, {"cache_dir": str(small)}]
    config = ImageEditDataloaderConfig(
        sources=sources,
        num_workers=0,
        on_corrupt_sample="skip",
        max_corrupt_fraction=0.5,
        quarantine_file=str(quarantine),
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    skipped = [entry for batch in built.dataloader for entry in batch["metadata"]["skipped_samples"]]
    assert {entry["index"] for entry in skipped} == {30, 34}, "mixture ids: the second source starts at 30"
    listed = [json.loads(line)["index"] for line in (tmp_path / "q.small.jsonl").read_text().splitlines()]
    assert sorted(listed) == [0, 4], "the source's own quarantine file lists its own sample numbers"
    assert not quarantine.exists()


def test_a_packed_source_with_a_shard_local_shuffle_reads_the_same_draws_as_its_unpacked_copy(
    caches: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Shards are numbered across sources; each unpacked sample counts as a shard of its own."""
    packed = tmp_path / "small_packed"
    pack_cache(tiny_cache(tmp_path / "small", counts=(3, 2, 2), suffix=".safetensors"), str(packed), shard_bytes=4096)

    def draws(small: Path, window: int) -> Counter[int]:
        sources = [{"cache_dir": str(caches[0]), "weight": 3}, {"cache_dir": str(small), "name": "small"}]
        config = ImageEditDataloaderConfig(sources=sources, num_workers=0, shard_window=window, drop_last=False)
        built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
        return Counter(i for batch in built.dataloader for i in batch["metadata"]["sample_indices"])

    assert draws(packed, 1) == draws(tmp_path / "small", 0), "the same samples, as often, in another order"
