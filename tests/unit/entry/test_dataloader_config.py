"""`ImageEditDataloaderConfig.build()` and exact resume of the stateful loader."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from support.caches import tiny_cache

from image_edit_data import DiffusionDataloaderBuild, ImageEditDataloaderConfig
from image_edit_data.dataloader_config import bucket_batch_sizes
from image_edit_data.dataset import ImageEditDataset


def config(cache: Path, **kwargs: object) -> ImageEditDataloaderConfig:
    return ImageEditDataloaderConfig(cache_dir=str(cache), **{"num_workers": 0, **kwargs})  # type: ignore[arg-type]


def ids(batch: dict) -> list[int]:
    return batch["metadata"]["sample_indices"]


def test_reference_fields_and_defaults() -> None:
    c = ImageEditDataloaderConfig(cache_dir="x")
    assert (c.quantization, c.base_resolution, c.drop_last, c.shuffle) == (64, (1024, 1024), True, True)
    assert (c.dynamic_batch_size, c.num_workers, c.pin_memory, c.prefetch_factor, c.seed) == (False, 4, True, 2, 42)
    assert c.bucket_order == "interleaved"


def test_build_returns_stateful_loader_and_its_sampler(cache: Path) -> None:
    built = config(cache).build(dp_rank=0, dp_world_size=1, batch_size=2)
    assert isinstance(built, DiffusionDataloaderBuild)
    from torchdata.stateful_dataloader import StatefulDataLoader

    assert isinstance(built.dataloader, StatefulDataLoader)
    assert built.dataloader.batch_sampler is built.sampler
    batches = list(built.dataloader)
    assert len(batches) == len(built.dataloader) == 6 + 5 + 4
    assert all(b["image_latents"].shape[0] == 2 for b in batches)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_rank": 2, "dp_world_size": 2, "batch_size": 1}, "dp_rank"),
        ({"dp_rank": -1, "dp_world_size": 2, "batch_size": 1}, "dp_rank"),
        ({"dp_rank": 0, "dp_world_size": 0, "batch_size": 1}, "dp_world_size"),
        ({"dp_rank": 0, "dp_world_size": 1, "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_build_arguments_are_value_errors(cache: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(cache).build(**kwargs)


def test_bad_loader_settings_are_value_errors(cache: Path) -> None:
    with pytest.raises(ValueError, match="prefetch_factor"):
        config(cache, prefetch_factor=0).build(dp_rank=0, dp_world_size=1, batch_size=1)
    with pytest.raises(ValueError, match="num_workers"):
        config(cache, num_workers=-1).build(dp_rank=0, dp_world_size=1, batch_size=1)


def test_ranks_get_disjoint_equal_batches(tmp_path: Path) -> None:
    """Bucket sizes that two ranks of batches of 2 divide evenly: no padding, so every sample goes to one rank once."""
    cache = tiny_cache(tmp_path, counts=(8, 12, 4))
    loaders = [config(cache).build(dp_rank=r, dp_world_size=2, batch_size=2).dataloader for r in range(2)]
    per_rank = [[ids(b) for b in loader] for loader in loaders]
    assert len(per_rank[0]) == len(per_rank[1]) == 6
    taken = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert sorted(taken) == list(range(24)) and set(taken.values()) == {1}


def test_ranks_share_only_the_samples_that_pad_an_uneven_bucket(cache: Path) -> None:
    """Buckets of 13, 11 and 9 samples: each is padded by one repeat so that both ranks get as many."""
    loaders = [config(cache).build(dp_rank=r, dp_world_size=2, batch_size=2).dataloader for r in range(2)]
    per_rank = [Counter(i for b in loader for i in ids(b)) for loader in loaders]
    assert sum(per_rank[0].values()) == sum(per_rank[1].values())
    assert set(per_rank[0].values()) == set(per_rank[1].values()) == {1}  # no rank sees a sample twice
    assert len(per_rank[0].keys() & per_rank[1].keys()) <= 3  # at most one padding repeat per bucket


def test_dynamic_batch_size_keeps_each_batch_within_one_token_budget(tmp_path: Path) -> None:
    small, large = (4, 8, 8), (4, 16, 16)
    cache = tiny_cache(tmp_path, counts=(20, 20), buckets=((small, (small,)), (large, (large, small))))
    dataset = ImageEditDataset(cache)
    sizes = bucket_batch_sizes(dataset, 4, True, (64, 64), 8)
    assert sizes == [4, 1]  # base: 2 cells of 64x64 px at q=64 -> budget 8; large bucket costs 4 + 1 = 5 cells
    c = config(cache, dynamic_batch_size=True, base_resolution=(64, 64), drop_last=False)
    for batch in c.build(dp_rank=0, dp_world_size=1, batch_size=4).dataloader:
        sig = dataset.index.signature(ids(batch)[0])
        assert len(ids(batch)) * sig.quantized_cells(64, 8) <= 8 or len(ids(batch)) == 1
        assert len(ids(batch)) >= 1


def test_iterating_does_not_touch_torchs_global_rng(cache: Path) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for nw in (0, 2):
        for _ in config(cache, num_workers=nw).build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader:
            pass
    assert torch.equal(before, torch.get_rng_state())


def test_worker_batches_equal_in_process_batches(cache: Path) -> None:
    in_process = list(config(cache, num_workers=0).build(dp_rank=0, dp_world_size=1, batch_size=3).dataloader)
    from_workers = list(config(cache, num_workers=2).build(dp_rank=0, dp_world_size=1, batch_size=3).dataloader)
    assert len(in_process) == len(from_workers)
    for a, b in zip(in_process, from_workers):
        for key in ("image_latents", "text_embeddings", "text_attention_mask"):
            assert torch.equal(a[key], b[key]), key
        assert all(torch.equal(x, y) for x, y in zip(a["context_latents"], b["context_latents"]))
        assert a["metadata"] == b["metadata"]
