"""The corrupt-sample policy: raise by default; skip deterministically, report, quarantine, cap."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from support.caches import tiny_cache
from support.packed_copies import flip_member_byte, sample_in_shard

from image_edit_data import CacheFormatError, ImageEditDataloaderConfig
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.payload.corrupt import TooManyCorruptSamplesError
from image_edit_data.preprocess.tools.pack import pack_cache

BAD = (2, 7)


def corrupt_cache(root: Path, bad: tuple[int, ...] = BAD) -> Path:
    tiny_cache(root, counts=(12, 10, 8))
    for i in bad:
        (root / f"samples/sample_{i:08d}.pt").write_bytes(b"PK\x03\x04 truncated")
    return root


def loader(cache: Path, batch_size: int = 2, **kwargs: object) -> ImageEditDataloaderConfig:
    return ImageEditDataloaderConfig(cache_dir=str(cache), num_workers=0, **kwargs)  # type: ignore[arg-type]


def epoch(config: ImageEditDataloaderConfig, batch_size: int = 2) -> list[dict]:
    return list(config.build(dp_rank=0, dp_world_size=1, batch_size=batch_size).dataloader)


def test_raise_is_the_default_and_names_the_file(tmp_path: Path) -> None:
    cache = corrupt_cache(tmp_path)
    with pytest.raises(CacheFormatError, match=r"samples/sample_0000000[27]\.pt: payload"):
        epoch(loader(cache, drop_last=False))


def test_skip_drops_bad_samples_from_their_batch_and_reports_them(tmp_path: Path) -> None:
    cache = corrupt_cache(tmp_path)
    clean = epoch(loader(tiny_cache(tmp_path / "clean", counts=(12, 10, 8)), drop_last=False))
    batches = epoch(loader(cache, drop_last=False, on_corrupt_sample="skip", max_corrupt_fraction=0.5))
    assert len(batches) == len(clean), "skipping never changes the number of batches"
    seen = [i for b in batches for i in b["metadata"]["sample_indices"]]
    assert sorted(seen) == sorted(set(range(30)) - set(BAD))
    reports = [s for b in batches for s in b["metadata"]["skipped_samples"]]
    assert sorted(r["index"] for r in reports) == list(BAD)
    assert all(r["field"] == "payload" and "torch.save" in r["reason"] for r in reports)
    assert sum(b["metadata"]["skipped"] for b in batches) == 2
    quarantine = (cache / ".image_edit_data/quarantine.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["file"] for line in quarantine) == [
        "samples/sample_00000002.pt",
        "samples/sample_00000007.pt",
    ]


def test_a_batch_of_one_bad_sample_takes_its_buckets_next_sample(tmp_path: Path) -> None:
    cache = corrupt_cache(tmp_path)
    config = loader(cache, on_corrupt_sample="skip", max_corrupt_fraction=0.5, shuffle=False)
    batches = epoch(config, batch_size=1)
    assert len(batches) == 30 and all(len(b["metadata"]["sample_indices"]) == 1 for b in batches)
    dataset = ImageEditDataset(cache)
    members = [m.tolist() for m in dataset.index.bucket_members()]
    for bad in BAD:
        bucket = next(m for m in members if bad in m)
        expected = bucket[(bucket.index(bad) + 1) % len(bucket)]
        replaced = [b for b in batches if b["metadata"]["skipped"]]
        assert any(b["metadata"]["sample_indices"] == [expected] for b in replaced)
    assert epoch(config, batch_size=1)[0]["metadata"]["sample_indices"] == batches[0]["metadata"]["sample_indices"]


def test_each_bad_sample_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = corrupt_cache(tmp_path)
    built = loader(cache, drop_last=False, on_corrupt_sample="skip", max_corrupt_fraction=0.5).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    with caplog.at_level(logging.WARNING, logger="image_edit_data.payload.corrupt"):
        for e in range(2):
            built.sampler.set_epoch(e)
            list(built.dataloader)
    assert len([r for r in caplog.records if "skipping corrupt sample" in r.message]) == 2


def test_skipping_more_than_the_allowed_fraction_fails(tmp_path: Path) -> None:
    cache = corrupt_cache(tmp_path, bad=(1, 2, 3, 4))
    with pytest.raises(TooManyCorruptSamplesError, match="max_corrupt_fraction=0.1 of 30 samples"):
        epoch(loader(cache, drop_last=False, on_corrupt_sample="skip", max_corrupt_fraction=0.1))


def test_policy_values_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_corrupt_sample"):
        ImageEditDataset(tiny_cache(tmp_path), on_corrupt_sample="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_corrupt_fraction"):
        ImageEditDataset(tmp_path, max_corrupt_fraction=2.0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_stays_exact_with_skips(tmp_path: Path, num_workers: int) -> None:
    cache = corrupt_cache(tmp_path)
    config = loader(cache, on_corrupt_sample="skip", max_corrupt_fraction=0.5)
    config.num_workers = num_workers
    full = [b["metadata"]["sample_indices"] for b in epoch(config)]
    first = config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader
    iterator = iter(first)
    head = [next(iterator)["metadata"]["sample_indices"] for _ in range(5)]
    state = first.state_dict()
    del iterator
    second = config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader
    second.load_state_dict(state)
    assert head + [b["metadata"]["sample_indices"] for b in second] == full


def damaged_packed_cache(root: Path) -> tuple[Path, int, str]:
    """A packed cache with one byte flipped inside a member: the cache, the sample and the member's display."""
    packed = root / "packed"
    pack_cache(tiny_cache(root / "source", counts=(12, 10, 8), suffix=".safetensors"), str(packed), shard_bytes=8192)
    victim = sample_in_shard(packed, 1)
    shard, member, _, _ = flip_member_byte(packed, victim)
    return packed, victim, f"{shard}[{member}]"


def test_skip_drops_and_quarantines_a_damaged_packed_member_and_resume_stays_exact(tmp_path: Path) -> None:
    cache, victim, display = damaged_packed_cache(tmp_path)
    config = loader(cache, on_corrupt_sample="skip", max_corrupt_fraction=0.5)
    batches = epoch(config)
    seen = [i for b in batches for i in b["metadata"]["sample_indices"]]
    assert victim not in seen and len(seen) == len(set(seen))
    (report,) = [s for b in batches for s in b["metadata"]["skipped_samples"]]
    assert (report["index"], report["file"], report["field"]) == (victim, display, "xxh3_64")
    assert "member bytes hash to" in report["reason"] and "the index says" in report["reason"]
    (line,) = (cache / ".image_edit_data/quarantine.jsonl").read_text().splitlines()
    assert json.loads(line)["file"] == display
    first = config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader
    iterator = iter(first)
    head = [next(iterator)["metadata"]["sample_indices"] for _ in range(6)]
    state = first.state_dict()
    del iterator
    second = config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader
    second.load_state_dict(state)
    assert head + [b["metadata"]["sample_indices"] for b in second] == [
        b["metadata"]["sample_indices"] for b in batches
    ]


def test_raise_names_the_damaged_packed_member_and_both_checksums(tmp_path: Path) -> None:
    cache, _, display = damaged_packed_cache(tmp_path)
    pattern = rf"{re.escape(display)}: xxh3_64: member bytes hash to [0-9a-f]{{16}}, the index says [0-9a-f]{{16}}"
    with pytest.raises(CacheFormatError, match=pattern):
        epoch(loader(cache, drop_last=False))
