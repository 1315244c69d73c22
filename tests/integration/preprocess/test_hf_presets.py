"""Claims about the named Hugging Face edit-set presets (`--hf-preset`): their columns, masks and prompt lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support.builds import png_bytes, write_lines, write_parquet
from support.peers import build, image

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.sources.hf_presets import preset_source


def mask(path: Path, size: tuple[int, int]) -> Path:
    """A mask the target's size, white over its left half."""
    picture = Image.new("L", size, 0)
    picture.paste(255, (0, 0, size[0] // 2, size[1]))
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.save(path)
    return path


def cell(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else {"bytes": png_bytes(Image.open(path)), "path": None}


def set_and_manifest(
    root: Path, columns: dict[str, str], rows: list[dict[str, Any]], metadata: list[str]
) -> tuple[Path, Path]:
    """A parquet file with the set's columns (images drawn here) and the manifest of the same examples."""
    data: dict[str, list[Any]] = {}
    lines = []
    for i, row in enumerate(rows):
        target, source = image(root / f"{i}_t.png", i), image(root / f"{i}_s.png", 10 + i)
        edit_mask = mask(root / f"{i}_m.png", Image.open(target).size) if row.pop("masked", False) else None
        values = {columns["target"]: cell(target), columns["context"]: cell(source), **row}
        if "mask" in columns:
            values[columns["mask"]] = cell(edit_mask)
        for key, value in values.items():
            data.setdefault(key, []).append(value)
        media = [{"role": "target", "file_name": target.name}, {"role": "context", "file_name": source.name}]
        if edit_mask is not None:
            media.append({"role": "mask", "file_name": edit_mask.name})
        prompt = row[columns["prompt"]]
        sample_id = row.get(columns.get("id", ""), str(i))
        lines.append(
            {
                "id": sample_id,
                "prompt": prompt[0] if isinstance(prompt, list) else prompt,
                "media": media,
                "metadata": {k: row[k] for k in metadata},
            }
        )
    images = [columns["target"], columns["context"], *([columns["mask"]] if "mask" in columns else [])]
    return write_parquet(root / "train.parquet", data, images), write_lines(root / "m.jsonl", lines)


def assert_same_samples(a: Path, b: Path) -> None:
    """Equal tensors (masks included) and metadata; a data set row has no media file names, a manifest line has."""
    first, second = ImageEditDataset(a), ImageEditDataset(b)
    assert len(first) == len(second) > 0
    for i in range(len(first)):
        x, y = first[i], second[i]
        for key in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
            assert torch.equal(x[key], y[key]), key
        assert all(torch.equal(p, q) for p, q in zip(x["context_latents"], y["context_latents"], strict=True))
        assert x["conditioning_tensors"].keys() == y["conditioning_tensors"].keys()
        assert all(torch.equal(t, y["conditioning_tensors"][k]) for k, t in x["conditioning_tensors"].items())
        assert {k: v for k, v in x["metadata"].items() if k != "media"} == {
            k: v for k, v in y["metadata"].items() if k != "media"
        }


PRESET_CASES = {
    "magicbrush": (
        {"target": "target_img", "context": "source_img", "prompt": "instruction", "mask": "mask_img"},
        [
            {"img_id": "242679", "turn_index": 1, "instruction": "put a hat on the dog", "masked": True},
            {"img_id": "242679", "turn_index": 2, "instruction": "make the hat red", "masked": True},
        ],
        ["img_id", "turn_index"],
    ),
    "instructpix2pix": (
        {"target": "edited_image", "context": "original_image", "prompt": "edit_prompt"},
        [
            {"original_prompt": "a dog", "edit_prompt": "make it a cat", "edited_prompt": "a cat"},
            {"original_prompt": "a road", "edit_prompt": "add snow", "edited_prompt": "a snowy road"},
        ],
        ["original_prompt", "edited_prompt"],
    ),
    "ultraedit": (
        {"target": "edited_image", "context": "source_image", "prompt": "edit_prompt", "mask": "mask_image"},
        [
            {"edit_prompt": "add a boat", "source_caption": "a lake", "target_caption": "a boat", "masked": True},
            {"edit_prompt": "make it night", "source_caption": "a city", "target_caption": "a city at night"},
        ],
        ["source_caption", "target_caption"],
    ),
    "omniedit": (
        {"target": "edited_img", "context": "src_img", "prompt": "edited_prompt_list", "id": "omni_edit_id"},
        [
            {"omni_edit_id": "oe-1", "task": "add", "edited_prompt_list": ["add a tree", "put a tree"], "o_score": 9.5},
            {"omni_edit_id": "oe-2", "task": "swap", "edited_prompt_list": ["swap the car"], "o_score": 7.0},
        ],
        ["task", "o_score"],
    ),
}


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_each_hf_preset_builds_the_cache_of_its_manifest(tmp_path: Path, name: str) -> None:
    columns, rows, metadata = PRESET_CASES[name]
    parquet, manifest = set_and_manifest(tmp_path / "raw", columns, [dict(r) for r in rows], metadata)
    built = build(tmp_path / "out", "--dataset", str(parquet), "--hf-preset", name)
    assert_same_samples(built, build(tmp_path / "ref", "--manifest", str(manifest)))
    masked = [("edit_mask" in s["conditioning_tensors"]) for s in ImageEditDataset(built)]
    assert masked == [bool(r.get("masked")) for r in rows]


def test_a_preset_on_a_set_without_its_columns_is_refused_naming_them(tmp_path: Path) -> None:
    columns, rows, metadata = PRESET_CASES["instructpix2pix"]
    parquet, _ = set_and_manifest(tmp_path, columns, [dict(r) for r in rows], metadata)
    with pytest.raises(
        ValueError, match=r"columns \['edited_img', 'src_img', 'edited_prompt_list', 'omni_edit_id'\] not found"
    ):
        preset_source("omniedit", parquet)
    build(tmp_path / "out", "--dataset", str(parquet), "--hf-preset", "magicbrush", expect=1)
