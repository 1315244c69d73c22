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

import pytest
import torch
from _pipeline_helpers import QWEN, build, edit_manifest
from PIL import Image

from image_edit_data.cache.resize import ResizePolicy
from image_edit_data.payload import load_payload

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


def both_caches(tmp_path: Path, pipeline: Path, dtype: str, batch_size: int) -> tuple[Path, Path]:
    """(ours, NeMo's) caches of one manifest."""
    manifest = edit_manifest(tmp_path / "raw", rows=6)
    ours = our_cache(tmp_path / "ours", manifest, pipeline, dtype, batch_size)
    encoder = preprocessing.QwenImageEditCacheEncoder(
        model_name=str(pipeline), max_sequence_length=512, device="cpu", torch_dtype=dtype
    )
    nemo = tmp_path / "nemo"
    encoder.encode_manifest(
        manifest_path=manifest, output_dir=nemo, max_pixels=4096, resolution_preset=None, num_gpus=1, verify=False
    )
    return ours, nemo


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
    assert mine["original_pixel_shapes"] == theirs["original_pixel_shapes"]


def test_a_float32_build_equals_nemos_preprocessor_exactly(tmp_path: Path, qwen_path: Path) -> None:
    # NeMo VAE-encodes one image at a time; with --batch-size 1 so do we, and every tensor is bit-identical.
    ours, nemo = both_caches(tmp_path, qwen_path, "float32", batch_size=1)
    pairs = payloads(ours, nemo)
    assert len(pairs) == 6 and {len(theirs["context_latents"]) for _, theirs in pairs} == {1, 2}
    for mine, theirs in pairs:
        assert torch.equal(mine["target_latent"], theirs["target_latent"])
        assert len(mine["context_latents"]) == len(theirs["context_latents"])
        assert all(torch.equal(a, b) for a, b in zip(mine["context_latents"], theirs["context_latents"]))
        assert torch.equal(mine["prompt_embeddings"], theirs["prompt_embeddings"])
        assert mine["prompt_attention_mask"].dtype == theirs["prompt_attention_mask"].dtype == torch.int64
        assert torch.equal(mine["prompt_attention_mask"], theirs["prompt_attention_mask"])
        assert mine["conditioning_tensors"] == theirs["conditioning_tensors"] == {}
        assert_same_metadata(mine["metadata"], theirs["metadata"])
    # Batched VAE calls may round differently in the last float32 bit; nothing else changes.
    batched = our_cache(tmp_path / "batched", tmp_path / "raw" / "edits.jsonl", qwen_path, "float32", batch_size=4)
    for mine, theirs in payloads(batched, nemo):
        for a, b in zip(
            [mine["target_latent"], *mine["context_latents"]], [theirs["target_latent"], *theirs["context_latents"]]
        ):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(mine["prompt_embeddings"], theirs["prompt_embeddings"])


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
