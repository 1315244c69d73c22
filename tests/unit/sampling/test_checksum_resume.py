"""Member checksums you can require, and whose loss a resume notices: a repack without them never resumes unchecked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from support.caches import tiny_cache
from support.packed_copies import copy_cache, drop_local_checksums

from image_edit_data import CacheSource, ImageEditDataloaderConfig, ImageEditDataset
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.sampling.mismatch import fingerprint_changes
from image_edit_data.sampling.sampler import ResumeMismatchError

REFUSED = "the cache is now packed without member checksums, so its reads would go unchecked where the checkpoint's"


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checksums")
    files = tiny_cache(root / "files", counts=(6, 4), suffix=".safetensors")
    packed = root / "packed"
    pack_cache(files, str(packed), shard_bytes=8192)
    unchecked = drop_local_checksums(
        copy_cache(packed, root / "unchecked")
    )  # the same shards, as packed before checksums
    other = tiny_cache(root / "other", counts=(5, 3))
    return {"files": files, "packed": packed, "unchecked": unchecked, "other": other}


def test_require_checksums_refuses_a_cache_whose_reads_would_go_unchecked_naming_it(caches: dict[str, Path]) -> None:
    ImageEditDataset(caches["packed"], require_checksums=True)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{caches['unchecked']}: require_checksums is set, but this cache has no member checksums "
            "(it was packed before"
        ),
    ):
        ImageEditDataset(caches["unchecked"], require_checksums=True)
    with pytest.raises(
        ValueError, match=re.escape(f"{caches['files']}: require_checksums is set") + ".*one file per sample"
    ):
        ImageEditDataloaderConfig(cache_dir=str(caches["files"]), require_checksums=True, num_workers=0).open_dataset()
    ImageEditDataset(caches["unchecked"])  # not required: read as before


def test_a_mixture_source_may_require_checksums_or_waive_the_configs_requirement(caches: dict[str, Path]) -> None:
    sources = [
        CacheSource(str(caches["packed"]), name="a"),
        CacheSource(str(caches["unchecked"]), name="b", require_checksums=True),
    ]
    with pytest.raises(ValueError, match=re.escape(f"{caches['unchecked']}: require_checksums is set")):
        ImageEditDataloaderConfig(sources=sources, num_workers=0).open_dataset()
    waived = [
        CacheSource(str(caches["packed"]), name="a"),
        CacheSource(str(caches["unchecked"]), name="b", require_checksums=False),
    ]
    assert ImageEditDataloaderConfig(
        sources=waived, require_checksums=True, num_workers=0
    ).open_dataset().unchecked == (False, True)


def position(config: ImageEditDataloaderConfig, batches: int = 2) -> dict[str, Any]:
    """The loader's state after `batches` batches of epoch 0."""
    loader = config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict()


def resume(config: ImageEditDataloaderConfig, state: dict[str, Any]) -> None:
    config.build(dp_rank=0, dp_world_size=1, batch_size=2).dataloader.load_state_dict(state)


def test_a_checkpoint_of_checked_data_does_not_resume_on_a_copy_without_checksums_and_the_reverse_does(
    caches: dict[str, Path],
) -> None:
    checked = ImageEditDataloaderConfig(cache_dir=str(caches["packed"]), num_workers=0)
    unchecked = ImageEditDataloaderConfig(cache_dir=str(caches["unchecked"]), num_workers=0)
    assert (
        ImageEditDataset(caches["packed"]).index.fingerprint == ImageEditDataset(caches["unchecked"]).index.fingerprint
    )
    state = position(checked)
    assert "member_checksums" not in state["image_edit_data_sampler"]["fingerprint"]  # older checkpoints match
    with pytest.raises(
        ResumeMismatchError, match=re.escape(f"member_checksums: checkpoint True, now False ({REFUSED}")
    ):
        resume(unchecked, state)
    resume(checked, state)
    back = position(unchecked)
    assert back["image_edit_data_sampler"]["fingerprint"]["member_checksums"] is False
    resume(unchecked, back)
    resume(checked, back)  # the data gained checksums: checked more, never less


def test_a_mixture_names_the_source_that_lost_its_checksums(caches: dict[str, Path]) -> None:
    def config(first: str) -> ImageEditDataloaderConfig:
        sources = [CacheSource(str(caches[first]), name="edits"), CacheSource(str(caches["other"]), name="more")]
        return ImageEditDataloaderConfig(sources=sources, num_workers=0)

    state = position(config("packed"))
    pattern = re.escape(f"sources[0].member_checksums ('edits'): checkpoint True, now False ({REFUSED}")
    with pytest.raises(ResumeMismatchError, match=pattern):
        resume(config("unchecked"), state)
    resume(config("packed"), position(config("unchecked")))


def test_only_a_loss_of_checksums_is_a_change() -> None:
    base = {"data": "a", "seed": 1}
    lost = {**base, "member_checksums": False}
    assert fingerprint_changes(base, lost, set()) == [
        f"member_checksums: checkpoint True, now False ({REFUSED} were checked; "
        "`image-edit-data cache pack` writes them)"
    ]
    assert fingerprint_changes(lost, base, set()) == []
    assert fingerprint_changes(lost, lost, set()) == []
    assert fingerprint_changes(base, lost, {"member_checksums"}) == []
