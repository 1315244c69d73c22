"""Claim: for the same manifest, images and pipeline, `cache build` writes what NeMo Automodel 0.7's preprocessor does.

NeMo's `QwenImageEditCacheEncoder` (the `qwen_image_edit` processor) runs here, in this process, on the
same tiny random Qwen-Image-Edit-Plus pipeline. scripts/setup.sh installs nemo-automodel with --no-deps
(its own pins, e.g. transformers==5.18, would replace ours); the preprocessor needs only our `build` extra.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from support.builds import drawing, write_lines
from support.pipelines import QWEN, build, edit_manifest

from image_edit_data.payload import load_payload
from image_edit_data.preprocess.run.resize import ResizePolicy

try:  # not skipped when absent: this claim must be checked wherever the suite runs
    from nemo_automodel.components.models.qwen_image_edit import preprocessing
except ImportError as error:
    raise ImportError(f"{error}; run scripts/setup.sh, which installs nemo-automodel==0.7.0 --no-deps") from error
# Payload metadata both tools write with the same meaning.
SHARED_METADATA = (
    "target_spatial_shape",
    "context_spatial_shapes",
    "compound_bucket_signature",
    "conditioning_shapes",
    "target_token_length",
    "context_token_lengths",
    "text_token_length",
    "manifest_metadata",
    "media",
)


pytestmark = pytest.mark.usefixtures("offline")


def our_cache(cache: Path, manifest: Path, pipeline: Path, dtype: str, batch_size: int) -> Path:
    """`cache build` with NeMo's settings: 64x64 pixel budget, its resize rule, 512 tokens, stored in `dtype`."""
    dtypes = ["--encoder.torch_dtype", dtype, "--store-dtype", dtype, "--resize", "max_pixels_floor"]
    build(
        cache,
        manifest,
        QWEN,
        pipeline,
        *dtypes,
        "--encoder.max_sequence_length",
        "512",
        "--batch-size",
        str(batch_size),
    )
    return cache


def nemo_cache(nemo: Path, manifest: Path, pipeline: Path, dtype: str) -> Path:
    """NeMo Automodel's preprocessor on `manifest`, with the settings `our_cache` mirrors."""
    encoder = preprocessing.QwenImageEditCacheEncoder(
        model_name=str(pipeline), max_sequence_length=512, device="cpu", torch_dtype=dtype
    )
    encoder.encode_manifest(
        manifest_path=manifest, output_dir=nemo, max_pixels=4096, resolution_preset=None, num_gpus=1, verify=False
    )
    return nemo


def both_caches(tmp_path: Path, pipeline: Path, dtype: str, batch_size: int) -> tuple[Path, Path]:
    """(ours, NeMo's) caches of one manifest."""
    manifest = edit_manifest(tmp_path / "raw", rows=6)
    ours = our_cache(tmp_path / "ours", manifest, pipeline, dtype, batch_size)
    return ours, nemo_cache(tmp_path / "nemo", manifest, pipeline, dtype)


def records(cache: Path) -> list[dict[str, Any]]:
    """Every index record, in shard order."""
    shards = json.loads((cache / "metadata.json").read_text())["shards"]
    return [record for shard in shards for record in json.loads((cache / shard).read_text())]


def payloads(ours: Path, nemo: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(ours, NeMo's) payload pairs, after checking both indexes hold the same records."""
    assert records(ours) == records(nemo)
    pairs = []
    for record in records(nemo):
        name = record["cache_file"]
        pairs.append((load_payload(ours / name, name), load_payload(nemo / name, name)))
    return pairs


def assert_same_metadata(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key in SHARED_METADATA:
        assert mine[key] == theirs[key], key
    assert mine["original_ids"]["id"] == theirs["original_ids"]["id"]
    assert mine["row_index"] == theirs["original_ids"]["row_index"]
    assert mine["original_pixel_shapes"] == theirs["original_pixel_shapes"]


def assert_same_tensors(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Bit-identical payload tensors: both built in this process, float32, one image per VAE call."""
    assert torch.equal(mine["target_latent"], theirs["target_latent"])
    assert len(mine["context_latents"]) == len(theirs["context_latents"])
    assert all(torch.equal(a, b) for a, b in zip(mine["context_latents"], theirs["context_latents"]))
    assert torch.equal(mine["prompt_embeddings"], theirs["prompt_embeddings"])
    assert torch.equal(mine["prompt_attention_mask"], theirs["prompt_attention_mask"])


@pytest.mark.slow  # builds the cache twice, once with NeMo's preprocessor
def test_a_float32_build_equals_nemos_preprocessor_exactly(tmp_path: Path, qwen_path: Path) -> None:
    # NeMo VAE-encodes one image at a time; with --batch-size 1 so do we, and every tensor is bit-identical.
    ours, nemo = both_caches(tmp_path, qwen_path, "float32", batch_size=1)
    pairs = payloads(ours, nemo)
    assert len(pairs) == 6 and {len(theirs["context_latents"]) for _, theirs in pairs} == {1, 2}
    for mine, theirs in pairs:
        assert_same_tensors(mine, theirs)
        assert mine["prompt_attention_mask"].dtype == theirs["prompt_attention_mask"].dtype == torch.int64
        assert mine["conditioning_tensors"] == theirs["conditioning_tensors"] == {}
        assert_same_metadata(mine["metadata"], theirs["metadata"])
    # Batched VAE and Qwen2.5-VL calls may round differently in the last float32 bits; nothing else changes.
    batched = our_cache(tmp_path / "batched", tmp_path / "raw" / "edits.jsonl", qwen_path, "float32", batch_size=4)
    for mine, theirs in payloads(batched, nemo):
        for a, b in zip(
            [mine["target_latent"], *mine["context_latents"]], [theirs["target_latent"], *theirs["context_latents"]]
        ):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine["prompt_embeddings"], theirs["prompt_embeddings"], rtol=0, atol=1e-6)
        assert torch.equal(mine["prompt_attention_mask"], theirs["prompt_attention_mask"])


@pytest.mark.slow  # builds the cache twice, once with NeMo's preprocessor
def test_a_bfloat16_build_equals_nemos_preprocessor_within_bfloat16_rounding(tmp_path: Path, qwen_path: Path) -> None:
    ours, nemo = both_caches(tmp_path, qwen_path, "bfloat16", batch_size=4)
    for mine, theirs in payloads(ours, nemo):
        # NeMo casts the loaded text encoder with .to(bfloat16), which also rounds its rotary inverse frequencies;
        # the pipeline loaded with dtype=bfloat16 (as we load it) keeps those buffers in float32.
        assert mine["prompt_embeddings"].dtype == theirs["prompt_embeddings"].dtype == torch.bfloat16
        torch.testing.assert_close(mine["prompt_embeddings"], theirs["prompt_embeddings"], rtol=2**-6, atol=2**-5)
        assert torch.equal(mine["prompt_attention_mask"], theirs["prompt_attention_mask"])
        # NeMo scales pixels to [-1, 1] in bf16, we (and the diffusers pipeline) in float32 before the cast,
        # so VAE inputs may differ by one bf16 step; latents stay within one bf16 step (2^-7 near 1).
        for a, b in zip(
            [mine["target_latent"], *mine["context_latents"]], [theirs["target_latent"], *theirs["context_latents"]]
        ):
            assert a.dtype == b.dtype == torch.bfloat16
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7)
        assert_same_metadata(mine["metadata"], theirs["metadata"])


def test_resize_mode_max_pixels_floor_gives_the_sizes_nemos_preprocessor_gives() -> None:
    rng = random.Random(0)
    sizes = [(70, 50), *((rng.randint(8, 300), rng.randint(8, 300)) for _ in range(300))]
    for budget in (32 * 32, 4096, 160 * 96):
        floor = ResizePolicy("max_pixels_floor", max_pixels=budget, spatial_alignment=32, upscale=True)
        for size in sizes:
            expected = preprocessing._resize_to_area(Image.new("RGB", size), target_area=budget).size
            assert floor.output_size(size, 8) == expected, (size, budget)
    # The default mode may round a side up when that keeps the aspect ratio closer.
    nearest = ResizePolicy("max_pixels", max_pixels=4096, spatial_alignment=32, upscale=True)
    assert nearest.output_size((70, 50), 8) == (64, 64)


# The edges: a filtered NeMo export and media entries with extra keys (equal), EXIF orientation and a condition
# image whose 384x384-area height sits on a rounding boundary (the documented differences).
ROW_INDICES = (3, 0, None, 1, 9)  # line 3 gives none, so its position (2) is its row index, as in NeMo
EXTRA_MEDIA_KEYS = {"caption": "the edited photo", "width": 80, "source": {"url": "https://example.org/1.jpg"}}


@pytest.fixture(scope="module")
def filtered_export(tmp_path_factory: pytest.TempPathFactory, qwen_path: Path) -> tuple[Path, Path, Path]:
    """(manifest, ours, NeMo's): five lines whose metadata.row_index has gaps and runs out of order."""
    root = tmp_path_factory.mktemp("filtered")
    manifest = edit_manifest(root / "raw", rows=len(ROW_INDICES))
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    for line, row_index in zip(lines, ROW_INDICES):
        if row_index is not None:
            line["metadata"]["row_index"] = row_index
        line["media"][0].update(EXTRA_MEDIA_KEYS)
        line["media"][-1]["note"] = "extra"
    write_lines(manifest, lines)
    ours = our_cache(root / "ours", manifest, qwen_path, "float32", batch_size=1)
    return manifest, ours, nemo_cache(root / "nemo", manifest, qwen_path, "float32")


@pytest.mark.slow  # builds the cache twice, once with NeMo's preprocessor
def test_a_filtered_export_is_named_and_ordered_by_its_row_index_as_nemos_preprocessor_does(
    filtered_export: tuple[Path, Path, Path],
) -> None:
    _, ours, nemo = filtered_export
    index = records(ours)
    assert [r["row_index"] for r in index] == [0, 1, 2, 3, 9]
    assert [r["original_id"] for r in index] == ["e01", "e03", "e02", "e00", "e04"]
    assert index[-1]["cache_file"] == "samples/sample_00000009.pt"
    assert sorted(p.name for p in (ours / "samples").iterdir()) == sorted(p.name for p in (nemo / "samples").iterdir())
    for mine, theirs in payloads(ours, nemo):  # also checks the index records are equal, in order
        assert_same_tensors(mine, theirs)
        assert_same_metadata(mine["metadata"], theirs["metadata"])


def test_media_entries_keep_only_role_and_file_name_as_in_nemos_payloads(
    filtered_export: tuple[Path, Path, Path],
) -> None:
    manifest, ours, nemo = filtered_export
    given = {json.loads(line)["id"]: json.loads(line)["media"] for line in manifest.read_text().splitlines()}
    for mine, theirs in payloads(ours, nemo):
        media = mine["metadata"]["media"]
        assert media == theirs["metadata"]["media"]
        sample_id = mine["metadata"]["original_ids"]["id"]
        assert given[sample_id][0]["caption"] == "the edited photo"  # the manifest did carry more
        assert media == [{"role": m["role"], "file_name": m["file_name"]} for m in given[sample_id]]


TALL_CONDITION = (576, 961)  # at 384x384 pixels: 297.29 x 495.99..., height rounded to 480 (NeMo: 496.0 -> 512)


@pytest.fixture(scope="module")
def differences(tmp_path_factory: pytest.TempPathFactory, qwen_path: Path) -> tuple[Path, Path, Path]:
    """(raw directory, ours, NeMo's) for: a photo with an EXIF rotation, its upright copy, a 576x961 condition."""
    raw = tmp_path_factory.mktemp("differences")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored 80x48 grid is shown turned 90 degrees clockwise, 48x80
    drawing((80, 48), 1).save(raw / "photo.jpg", quality=95, exif=exif)
    with Image.open(raw / "photo.jpg") as photo:
        ImageOps.exif_transpose(photo).convert("RGB").save(raw / "upright.png")
    drawing((64, 64), 2).save(raw / "small.png")
    drawing(TALL_CONDITION, 3).save(raw / "tall.png")
    lines = []
    # (id, target, condition); every line's context is small.png.
    for sample_id, target, condition in (
        ("exif", "photo.jpg", "photo.jpg"),
        ("upright", "upright.png", "upright.png"),
        ("tall", "small.png", "tall.png"),
    ):
        roles = (("target", target), ("context", "small.png"), ("condition", condition))
        media = [{"role": role, "file_name": name} for role, name in roles]
        metadata = {"dataset_name": "edges", "dataset_split": "train"}
        lines.append({"id": sample_id, "prompt": "make the sky red", "media": media, "metadata": metadata})
    manifest = write_lines(raw / "edits.jsonl", lines)
    ours = our_cache(raw / "ours", manifest, qwen_path, "float32", batch_size=1)
    return raw, ours, nemo_cache(raw / "nemo", manifest, qwen_path, "float32")


def by_id(cache: Path) -> dict[str, dict[str, Any]]:
    """Every payload of `cache`, by sample id."""
    loaded = [load_payload(cache / r["cache_file"], r["cache_file"]) for r in records(cache)]
    return {payload["metadata"]["original_ids"]["id"]: payload for payload in loaded}


def test_an_exif_rotated_photo_is_read_upright_as_diffusers_load_image_reads_it_where_nemo_reads_the_stored_grid(
    differences: tuple[Path, Path, Path],
) -> None:
    from diffusers.utils import load_image

    raw, ours, nemo = differences
    with Image.open(raw / "upright.png") as upright:  # what a diffusers pipeline is given at inference
        assert np.array_equal(np.asarray(load_image(str(raw / "photo.jpg"))), np.asarray(upright))
    mine, theirs = by_id(ours), by_id(nemo)
    # Ours of the rotated photo is NeMo's of its upright copy, bit for bit (float32, one image per VAE call).
    assert_same_tensors(mine["exif"], theirs["upright"])
    assert mine["exif"]["metadata"]["original_pixel_shapes"]["target"] == [80, 48]  # [H, W] as shown
    # NeMo encodes the grid as stored, on its side.
    assert theirs["exif"]["metadata"]["original_pixel_shapes"]["target"] == [48, 80]
    assert theirs["exif"]["metadata"]["target_spatial_shape"] == mine["exif"]["metadata"]["target_spatial_shape"][::-1]


def test_a_condition_image_is_resized_as_the_qwen_pipeline_resizes_it_where_nemo_rounds_its_height_up(
    differences: tuple[Path, Path, Path], qwen_path: Path
) -> None:
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    raw, ours, nemo = differences
    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, TALL_CONDITION[0] / TALL_CONDITION[1])
    assert (width, height) == (288, 480)
    assert by_id(nemo)["tall"]["metadata"]["preprocessed_pixel_shapes"]["conditions"] == [[512, 288]]
    # What the pipeline's __call__ gives its transformer for this prompt and image: resize, then encode_prompt.
    pipeline = QwenImageEditPlusPipeline.from_pretrained(qwen_path, transformer=None, dtype=torch.float32)
    with Image.open(raw / "tall.png") as image:
        condition = pipeline.image_processor.resize(image.convert("RGB"), height, width)
    with torch.no_grad():
        expected, _ = pipeline.encode_prompt(prompt="make the sky red", image=[condition], max_sequence_length=512)
    mine, theirs = by_id(ours)["tall"], by_id(nemo)["tall"]
    assert torch.equal(mine["prompt_embeddings"], expected[0])  # same process, threads and shapes: exact
    assert_same_tensors({**mine, "prompt_embeddings": theirs["prompt_embeddings"]}, theirs)  # the rest is equal
    assert not torch.equal(mine["prompt_embeddings"], theirs["prompt_embeddings"])  # NeMo's Qwen saw other pixels
