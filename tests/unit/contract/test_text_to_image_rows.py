"""Claims about text-to-image rows: samples with zero context images, built on request, read, bucketed and collated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support.builds import DEMO_SPECS, drawing, png_bytes, write_parquet
from support.manifests import KEEP, PROMPTS, build, mixed_manifest

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset, collate_image_edit
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.sources.base import BadSampleError

# Raw images are drawn at 32x32 and kept (multiples of 16): demo latents are [4, 4, 4].


def test_a_row_without_context_is_a_bad_sample_unless_the_build_allows_text_to_image_rows(tmp_path: Path) -> None:
    manifest = mixed_manifest(tmp_path / "raw", rows=2)
    expected = (
        r"rows.jsonl line 1: media: expected at least one entry with role 'context', got none "
        r"\(a text-to-image row: build with allow_no_context \(--allow-no-context\) to write it\)"
    )
    with pytest.raises(BadSampleError, match=expected) as refused:
        build(manifest, tmp_path / "edits")
    assert refused.value.kind == "no context"
    skipped = build(manifest, tmp_path / "skipped", on_bad_sample="skip")
    assert skipped.merged.samples == 1 and skipped.skipped == {"no context": 1}
    report = build(manifest, tmp_path / "rows", allow_no_context=True)
    assert report.merged.samples == 2 and report.skipped == {}
    # The option fixes what the cache holds: recorded only when set, and a rerun must repeat it.
    assert json.loads((tmp_path / "rows" / "metadata.json").read_text())["allow_no_context"] is True
    assert "allow_no_context" not in json.loads((tmp_path / "skipped" / "metadata.json").read_text())
    changed = r"different settings(?s:.*)allow_no_context: cache built with true, now \(not"
    with pytest.raises(ValueError, match=changed):
        build(manifest, tmp_path / "rows")


@pytest.mark.parametrize("payload_format", ["pt", "safetensors"])
def test_text_to_image_rows_load_with_no_context_and_never_share_a_batch_with_edits(
    tmp_path: Path, payload_format: str
) -> None:
    build(mixed_manifest(tmp_path / "raw"), tmp_path / "cache", allow_no_context=True, payload_format=payload_format)
    dataset = ImageEditDataset(tmp_path / "cache")
    # One target shape, two buckets: the compound signature tells the context count apart.
    assert dataset.get_bucket_info()["buckets"] == {
        "target=4x4x4/contexts=[]": 3,
        "target=4x4x4/contexts=[4x4x4]": 2,
    }
    row = dataset[0]
    assert row["context_latents"] == [] and row["target_latent"].shape == (4, 4, 4)
    assert row["metadata"]["context_spatial_shapes"] == [] and row["metadata"]["context_token_lengths"] == []
    assert row["metadata"]["compound_bucket_signature"] == {"target": [4, 4, 4], "contexts": []}
    loader = ImageEditDataloaderConfig(cache_dir=str(tmp_path / "cache"), num_workers=0, drop_last=False).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    batches = list(loader.dataloader)
    assert sorted(i for b in batches for i in b["metadata"]["sample_indices"]) == [0, 1, 2, 3, 4]
    for batch in batches:
        rows = [i % 2 == 0 for i in batch["metadata"]["sample_indices"]]
        assert all(rows) or not any(rows), "a batch mixed text-to-image rows and edits"
        meta = batch["metadata"]
        if rows[0]:
            assert batch["context_latents"] == [] and meta["context_token_count"] == 0
            # Token counts: the target's 2x2 patches (4 tokens) and the prompt's words, nothing for contexts.
            assert meta["total_token_counts"] == [4 + t for t in meta["text_token_counts"]]
        else:
            assert [tuple(c.shape) for c in batch["context_latents"]] == [(len(rows), 4, 4, 4)]
            assert meta["context_token_counts"] == [4] * len(rows)


def test_collate_refuses_a_batch_mixing_a_text_to_image_row_and_an_edit(tmp_path: Path) -> None:
    build(mixed_manifest(tmp_path / "raw", rows=2), tmp_path / "cache", allow_no_context=True)
    dataset = ImageEditDataset(tmp_path / "cache")
    message = (
        r"one compound signature: ordered context_latents shapes/dtypes of sample 1 is \[4, 4, 4\] float32, "
        r"sample 0 has none \(a text-to-image row\)"
    )
    with pytest.raises(ValueError, match=message):
        collate_image_edit([dataset[0], dataset[1]])


def test_a_data_set_row_whose_context_cells_are_all_empty_is_a_text_to_image_row(tmp_path: Path) -> None:
    from image_edit_data.preprocess.sources.hf import HFDatasetSource

    image = {"bytes": png_bytes(drawing((32, 32), 1)), "path": None}
    columns = {
        "target_img": [image] * 3,
        "source_img": [image, None, None],
        "extra_img": [[image], [], [image]],
        "instruction": ["make it red", "a red circle", "make it blue"],
    }
    path = write_parquet(tmp_path / "pq" / "rows.parquet", columns)
    hf = {"hf_cache_dir": str(tmp_path / "hf")}
    source = HFDatasetSource(path, "target_img", ["source_img", "extra_img"], "instruction", **hf)
    assert len(source.read(0).sample.contexts) == 2 and source.read(1).sample.contexts == ()
    with pytest.raises(BadSampleError, match=r"row 2: source_img: expected a context image, got None"):
        source.read(2)  # one context of two: not a text-to-image row but a broken edit
    # A data set of text-to-image rows maps no context column at all.
    rows = HFDatasetSource(path, "target_img", [], "instruction", **hf)
    options = BuildOptions(resize=KEEP, num_workers=1)
    with pytest.raises(BadSampleError, match="context_columns: expected a context image column, got none"):
        build_cache(tmp_path / "refused", rows, *DEMO_SPECS, options)
    report = build_cache(tmp_path / "cache", rows, *DEMO_SPECS, BuildOptions(resize=KEEP, allow_no_context=True))
    assert report.merged.samples == 3
    assert all(ImageEditDataset(tmp_path / "cache")[i]["context_latents"] == [] for i in range(3))


def test_a_kontext_text_to_image_prompt_is_encoded_as_an_edit_prompt_is(kontext_encoder: Any) -> None:
    """FLUX.1 Kontext without a context image is FLUX text-to-image: the same T5 and CLIP encoding."""
    image = drawing((64, 64), 3)
    alone, edit = kontext_encoder.encode_prompts(["make the sky red"] * 2, [(), (image,)])
    assert torch.equal(alone.embeddings, edit.embeddings) and torch.equal(alone.mask, edit.mask)
    assert torch.equal(alone.conditioning["pooled_prompt_embeds"], edit.conditioning["pooled_prompt_embeds"])


@pytest.fixture(scope="module")
def kontext_encoder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from support.pipelines import flux_kontext_pipeline

    from image_edit_data.preprocess.encoders.pipelines import FluxKontextEncoder

    path = flux_kontext_pipeline(tmp_path_factory.mktemp("pipelines") / "flux-kontext")
    return FluxKontextEncoder(str(path), torch_dtype="float32")


@pytest.mark.usefixtures("offline")
def test_a_qwen_text_to_image_row_is_encoded_with_the_text_to_image_pipelines_template(
    tmp_path: Path, qwen_path: Path
) -> None:
    from diffusers import QwenImagePipeline
    from support.pipelines import QWEN
    from support.pipelines import build as cli_build

    raw = tmp_path / "raw"
    manifest = mixed_manifest(raw, rows=2)
    cli_build(tmp_path / "cache", manifest, QWEN, qwen_path, "--encoder.torch_dtype", "float32", "--allow-no-context")
    dataset = ImageEditDataset(tmp_path / "cache")
    row, edit = dataset[0], dataset[1]
    assert row["context_latents"] == [] and len(edit["context_latents"]) == 1
    # What Qwen-Image's own text-to-image pipeline gives its transformer for this prompt.
    pipeline = QwenImagePipeline.from_pretrained(
        qwen_path, transformer=None, vae=None, dtype=torch.float32, local_files_only=True
    )
    expected, mask = pipeline.encode_prompt(prompt=[PROMPTS[0]], device="cpu", max_sequence_length=512)
    assert mask is None  # every position a real token, as the cache's all-ones mask says
    assert torch.equal(row["prompt_embeddings"], expected[0]) and bool(row["prompt_attention_mask"].all())
    # The edit row's prompt went through the edit template with its image: a different sequence.
    assert edit["prompt_embeddings"].shape[0] != row["prompt_embeddings"].shape[0]


@pytest.mark.usefixtures("offline")
def test_a_long_qwen_text_to_image_prompt_is_cut_where_the_pipeline_cuts_and_says_so(qwen_path: Path) -> None:
    from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

    encoder = QwenImageEditEncoder(str(qwen_path), torch_dtype="float32")
    long_prompt = "a red circle " * 50  # the test tokenizer has one token per byte: 650 prompt tokens
    (cut,) = encoder.encode_prompts([long_prompt], [()])
    assert cut.embeddings.shape[0] == 512 and cut.mask.shape == (512,)
    assert [t.to_json() for t in cut.truncations] == [
        {
            "encoder": "Qwen2.5-VL",
            "tokens": cut.truncations[0].tokens,
            "kept": 512,
            "cause": "QwenImagePipeline's default max_sequence_length 512",
        }
    ]
    assert cut.truncations[0].tokens > 650  # the prompt's bytes and what the template leaves after its drop
    (short,) = encoder.encode_prompts([long_prompt[:26]], [(Image.new("RGB", (48, 80)),)])
    assert short.truncations == ()
