"""Claims about the named Hugging Face edit-set presets (`--hf-preset`): their columns, masks, prompt lists and splits.

The fixtures follow the sets as they are published: MagicBrush's hub folder (`data/train-0000k-of-00002-<hash>.parquet`
beside `data/dev-00000-of-00001-<hash>.parquet`), its `mask_img` as its maintainers describe it (an RGBA copy of the
photo with the edit region erased, of another size than the image: OSU-NLP-Group/MagicBrush issue 10), and
UltraEdit's `mask_image` as its own training script reads it (white = edit region, resized with the images, a
missing mask standing for the whole image).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.builds import png_bytes, write_lines, write_parquet
from support.peers import build, image

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.sources.hf_presets import PRESETS, preset_source

EDIT_MASK = "edit_mask"
MaskCase = Callable[[Path, tuple[int, int]], tuple[Image.Image, Image.Image | None]]


def photo(size: tuple[int, int], seed: int) -> np.ndarray:
    """A non-uniform RGB picture (random pixels), `[H, W, 3]` uint8."""
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def magicbrush_mask(root: Path, size: tuple[int, int]) -> tuple[Image.Image, Image.Image | None]:
    """MagicBrush's `mask_img`: the photo at half the image's size with its left half erased (alpha 0), and the binary
    mask its maintainers' recipe gives for it: resize to the image, then 1 wherever alpha is not 255."""
    half = (size[0] // 2, size[1] // 2)
    alpha = np.full((half[1], half[0]), 255, dtype=np.uint8)
    alpha[:, : half[0] // 2] = 0
    masked = Image.fromarray(np.dstack([photo(half, 7), alpha]), "RGBA")
    resized_alpha = np.array(masked.resize(size))[:, :, 3]
    return masked, Image.fromarray(((resized_alpha != 255) * 255).astype(np.uint8), "L")


def ultraedit_mask(root: Path, size: tuple[int, int]) -> tuple[Image.Image, Image.Image | None]:
    """UltraEdit's `mask_image` at twice the image's size, white over the left half, and what its training script
    gives for it: the mask converted to RGB and resized to the image, read here as its grey level."""
    double = (size[0] * 2, size[1] * 2)
    mask = Image.new("L", double, 0)
    mask.paste(255, (0, 0, size[0], double[1]))
    return mask, mask.convert("RGB").resize(size).convert("L")


def no_mask_in_ultraedit(root: Path, size: tuple[int, int]) -> tuple[Image.Image | None, Image.Image | None]:
    """A row without a mask: UltraEdit's script substitutes an all-white image (the whole image is edited)."""
    return None, Image.new("L", size, 255)


def cell(picture: Image.Image | None) -> dict[str, Any] | None:
    return None if picture is None else {"bytes": png_bytes(picture), "path": None}


def set_and_manifest(
    root: Path, columns: dict[str, str], rows: list[dict[str, Any]], metadata: list[str], parquet: Path | None = None
) -> tuple[Path, Path]:
    """A parquet file (default `root/train.parquet`) with the set's columns (images drawn in `root`) and the manifest
    of the same examples (absolute file names), each row's mask (`mask`: a MaskCase) as the grey `mask` entry the
    set's own recipe gives."""
    data: dict[str, list[Any]] = {}
    lines = []
    for i, row in enumerate(rows):
        target, source = image(root / f"{i}_t.png", i), image(root / f"{i}_s.png", 10 + i)
        make_mask = row.pop("mask", None)
        drawn, expected = make_mask(root, Image.open(target).size) if make_mask else (None, None)
        values = {columns["target"]: cell(Image.open(target)), columns["context"]: cell(Image.open(source)), **row}
        if "mask" in columns:
            values[columns["mask"]] = cell(drawn)
        for key, value in values.items():
            data.setdefault(key, []).append(value)
        media = [{"role": "target", "file_name": str(target)}, {"role": "context", "file_name": str(source)}]
        if expected is not None:
            expected.save(root / f"{i}_expected_mask.png")
            media.append({"role": "mask", "file_name": str(root / f"{i}_expected_mask.png")})
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
    return write_parquet(parquet or root / "train.parquet", data, images), write_lines(root / "m.jsonl", lines)


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


MAGICBRUSH = {"target": "target_img", "context": "source_img", "prompt": "instruction", "mask": "mask_img"}
PRESET_CASES = {
    "magicbrush": (
        MAGICBRUSH,
        [
            {"img_id": "242679", "turn_index": 1, "instruction": "put a hat on the dog", "mask": magicbrush_mask},
            {"img_id": "242679", "turn_index": 2, "instruction": "make the hat red", "mask": magicbrush_mask},
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
            {
                "edit_prompt": "add a boat",
                "source_caption": "a lake",
                "target_caption": "a boat",
                "mask": ultraedit_mask,
            },
            {
                "edit_prompt": "make it night",
                "source_caption": "a city",
                "target_caption": "a city at night",
                "mask": no_mask_in_ultraedit,
            },
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
    masked = [(EDIT_MASK in s["conditioning_tensors"]) for s in ImageEditDataset(built)]
    assert masked == [PRESETS[name].mask is not None] * len(rows)


def test_a_magicbrush_mask_of_another_size_is_its_transparent_region_not_its_picture(tmp_path: Path) -> None:
    parquet, _ = set_and_manifest(
        tmp_path / "raw",
        MAGICBRUSH,
        [{"img_id": "1", "turn_index": 1, "instruction": "add a hat", "mask": magicbrush_mask}],
        ["img_id", "turn_index"],
    )
    weights = ImageEditDataset(build(tmp_path / "out", "--dataset", str(parquet), "--hf-preset", "magicbrush"))[0]
    mask = weights["conditioning_tensors"][EDIT_MASK]  # the erased left half of the 16x16 mask over a 32x32 target
    assert torch.all(mask[:, 0] == 1.0) and torch.all(mask[:, -1] == 0.0)
    # The erased region spans whole columns; the random picture behind it would make rows differ if it showed.
    assert torch.equal(mask, mask[:1].expand_as(mask))


def test_a_magicbrush_mask_without_alpha_is_a_bad_sample_naming_the_row(tmp_path: Path) -> None:
    def grey(root: Path, size: tuple[int, int]) -> tuple[Image.Image, None]:
        return Image.new("L", size, 255), None

    parquet, _ = set_and_manifest(
        tmp_path, MAGICBRUSH, [{"img_id": "1", "turn_index": 1, "instruction": "x", "mask": grey}], ["img_id"]
    )
    source = preset_source("magicbrush", parquet, hf_cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"row 0: mask_img: expected an RGBA masked image .* got a L image"):
        source.read(0)


def magicbrush_hub_folder(root: Path) -> dict[str, Path]:
    """MagicBrush as the hub holds it: `data/` with two train shards and one dev shard; a manifest per split."""
    rows = [{"img_id": str(i), "turn_index": 1, "instruction": f"edit {i}", "mask": magicbrush_mask} for i in range(4)]
    shards = {"train-00000-of-00002-a1b2.parquet": rows[:2], "train-00001-of-00002-c3d4.parquet": rows[2:3]}
    shards["dev-00000-of-00001-e5f6.parquet"] = rows[3:]
    lines: dict[str, list[dict[str, Any]]] = {"train": [], "dev": []}
    for name, part in shards.items():
        rows_of = [dict(r) for r in part]
        _, manifest = set_and_manifest(
            root / "raw" / name, MAGICBRUSH, rows_of, ["img_id", "turn_index"], root / "data" / name
        )
        split = lines[name.split("-")[0]]
        for text in manifest.read_text().splitlines():  # a row's id is its number in its split, shards in order
            split.append({**json.loads(text), "id": str(len(split))})
    return {split: write_lines(root / f"{split}.jsonl", items) for split, items in lines.items()}


def test_a_hub_folder_with_two_splits_builds_only_the_split_asked_for(tmp_path: Path, capsys: Any) -> None:
    manifests = magicbrush_hub_folder(tmp_path / "MagicBrush")
    for split, rows in (("train", 3), ("dev", 1)):
        built = build(
            tmp_path / split,
            "--dataset",
            str(tmp_path / "MagicBrush" / "data"),
            "--split",
            split,
            "--hf-preset",
            "magicbrush",
        )
        assert len(ImageEditDataset(built)) == rows  # the shards of that split, none of the other
        # the train manifest's lines are its two shards' rows in file order
        assert_same_samples(built, build(tmp_path / f"ref_{split}", "--manifest", str(manifests[split])))
    capsys.readouterr()
    build(tmp_path / "none", "--dataset", str(tmp_path / "MagicBrush"), "--hf-preset", "magicbrush", expect=1)
    assert "holds the splits ['dev', 'train']; choose one with --split" in capsys.readouterr().out
    build(
        tmp_path / "test",
        "--dataset",
        str(tmp_path / "MagicBrush"),
        "--split",
        "test",
        "--hf-preset",
        "magicbrush",
        expect=1,
    )
    assert "split: expected one of ['dev', 'train'], got 'test'" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_every_preset_reads_one_split_of_a_folder_and_refuses_to_guess(tmp_path: Path, name: str) -> None:
    columns, rows, metadata = PRESET_CASES[name]
    for split, part in (("train", rows), ("test", rows[:1])):
        shard = tmp_path / "set" / "data" / f"{split}-00000-of-00001.parquet"
        set_and_manifest(tmp_path / "raw" / split, columns, [dict(r) for r in part], metadata, shard)
    cache = str(tmp_path / "hf")
    assert len(preset_source(name, tmp_path / "set", split="test", hf_cache_dir=cache)) == 1
    assert len(preset_source(name, tmp_path / "set", split="train", hf_cache_dir=cache)) == len(rows)
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]; choose one with --split"):
        preset_source(name, tmp_path / "set", hf_cache_dir=cache)


def test_a_preset_on_a_set_without_its_columns_is_refused_naming_them(tmp_path: Path) -> None:
    columns, rows, metadata = PRESET_CASES["instructpix2pix"]
    parquet, _ = set_and_manifest(tmp_path, columns, [dict(r) for r in rows], metadata)
    with pytest.raises(
        ValueError, match=r"columns \['edited_img', 'src_img', 'edited_prompt_list', 'omni_edit_id'\] not found"
    ):
        preset_source("omniedit", parquet)
    build(tmp_path / "out", "--dataset", str(parquet), "--hf-preset", "magicbrush", expect=1)
