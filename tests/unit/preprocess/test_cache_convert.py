"""`cache convert` rewrites payloads in the other format with the same samples in the same order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.caches import make_payload, same_samples, tiny_cache, write_cache

from image_edit_data.dataset import ImageEditDataset
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.preprocess.tools.convert import convert_cache


def test_a_nemo_cache_converts_to_safetensors_and_back(tmp_path: Path) -> None:
    cond = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    source = write_cache(tmp_path / "pt", [make_payload(i, conditioning=cond) for i in range(5)], shards=2)
    assert cache_main(["convert", str(source), str(tmp_path / "st")]) == 0
    converted = ImageEditDataset(tmp_path / "st")
    assert all(p.suffix == ".safetensors" for p in (tmp_path / "st" / "samples").iterdir())
    same_samples(ImageEditDataset(source), converted)
    records = json.loads((tmp_path / "st" / "metadata_shard_0000.json").read_text())
    assert records[0]["target_token_length"] == 64 and records[0]["text_token_length"] == 5
    convert_cache(tmp_path / "st", tmp_path / "back", "pt")
    same_samples(converted, ImageEditDataset(tmp_path / "back"))


def test_a_rerun_reuses_finished_payloads_and_an_existing_cache_is_not_overwritten(tmp_path: Path) -> None:
    source = tiny_cache(tmp_path / "src")
    out = tmp_path / "out"
    (out / "samples").mkdir(parents=True)
    convert_cache(source, out, "safetensors")
    (out / "metadata.json").unlink()  # as if the first run died before writing the index
    report = convert_cache(source, out, "safetensors")
    assert (report.converted, report.reused) == (0, 12)
    same_samples(ImageEditDataset(source), ImageEditDataset(out))
    with pytest.raises(ValueError, match="already holds a finished cache"):
        convert_cache(source, out, "safetensors")
