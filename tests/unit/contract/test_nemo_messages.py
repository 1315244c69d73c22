"""Claim: a fault NeMo Automodel's reader refuses is refused here too, naming file and field, in words its tests match.

NeMo Automodel's own tests of its image-edit reader match a phrase of each error message; a user
whose tests do the same switches to us in one import line. Each phrase below is NeMo's (from its
`tests/unit_tests/datasets/diffusion/test_image_edit_dataset.py`); the faults are built as NeMo's
tests build them, on caches written by `support.caches` in NeMo's layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from support.caches import make_payload, write_cache

from image_edit_data import CacheFormatError, ImageEditDataloaderConfig, ImageEditDataset

FIRST = "samples/sample_00000000.pt"


def test_tensors_that_disagree_with_the_shard_signature(tmp_path: Path) -> None:
    def wrong_signature(i: int, record: dict) -> None:
        record["compound_bucket_signature"] = {"target": [4, 16, 4], "contexts": [[4, 8, 8]]}

    write_cache(tmp_path, [make_payload(0)], edit_record=wrong_signature)
    dataset = ImageEditDataset(tmp_path)
    nemo = "do not match metadata shard signature"
    with pytest.raises(CacheFormatError, match=f"^{FIRST}: compound_bucket_signature: .*{nemo}"):
        dataset[0]


def test_a_prompt_mask_of_the_wrong_length(tmp_path: Path) -> None:
    payload = make_payload(0, sequence=4)
    payload["prompt_attention_mask"] = torch.ones(3, dtype=torch.bool)
    dataset = ImageEditDataset(write_cache(tmp_path, [payload]))
    nemo = "prompt_attention_mask must have shape"
    with pytest.raises(CacheFormatError, match=f"^{FIRST}: prompt_attention_mask: .*{nemo}"):
        dataset[0]


def test_a_declared_conditioning_shape_of_the_wrong_rank(tmp_path: Path) -> None:
    payload = make_payload(0, conditioning={"image_grid_thw": torch.arange(3)})
    payload["metadata"]["conditioning_shapes"]["image_grid_thw"] = [1, 3]
    dataset = ImageEditDataset(write_cache(tmp_path, [payload]))
    field = re.escape("metadata.conditioning_shapes.image_grid_thw")
    with pytest.raises(CacheFormatError, match=f"^{FIRST}: {field}: .*must contain exactly 1 dimensions"):
        dataset[0]


def test_conditioning_tensors_that_cannot_share_a_batch(tmp_path: Path) -> None:
    first = make_payload(0, conditioning={"image_grid_thw": torch.arange(3)})
    second = make_payload(1, conditioning={"image_grid_thw": torch.arange(3).reshape(1, 3)})
    config = ImageEditDataloaderConfig(cache_dir=str(write_cache(tmp_path, [first, second])), num_workers=0)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    with pytest.raises(ValueError, match=r"conditioning tensor 'image_grid_thw' .*same shape and dtype"):
        next(iter(built.dataloader))


def test_a_payload_path_outside_the_cache_is_refused_when_the_cache_opens(tmp_path: Path) -> None:
    """NeMo refuses it at `dataset[0]`; we refuse it before anything trains, when the index is read."""
    outside = tmp_path / "outside.pt"
    torch.save(make_payload(0), outside)
    cache = write_cache(tmp_path / "cache", [make_payload(0)])
    shard = cache / "metadata_shard_0000.json"
    records = json.loads(shard.read_text())
    records[0]["cache_file"] = str(outside)
    shard.write_text(json.dumps(records))
    nemo = "outside cache directory"
    with pytest.raises(CacheFormatError, match=rf"^metadata_shard_0000.json: \[0\].cache_file: .*{nemo}"):
        ImageEditDataset(cache)
