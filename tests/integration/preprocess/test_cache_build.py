"""Claims about building caches with real (tiny, random, local) diffusers and transformers models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.builds import (
    DEMO_SPECS,
    InterruptedImageEncoder,
    drawing,
    hf_specs,
    index_files,
    parquet_rows,
    tiny_text_model,
    tiny_vae,
    write_lines,
    write_manifest,
    write_parquet,
)
from support.caches import same_samples

from image_edit_data import ImageEditDataModule, ImageEditDataset
from image_edit_data.preprocess.encoders.base import PromptTruncationWarning, Truncation
from image_edit_data.preprocess.encoders.hf import DiffusersVAEEncoder, TransformersTextEncoder
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.resize import ResizePolicy, to_pixels
from image_edit_data.preprocess.sources.hf import HFDatasetSource
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

RESIZE = ResizePolicy("max_pixels", max_pixels=32 * 32, spatial_alignment=16, upscale=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("models")
    return hf_specs(tiny_vae(root / "vae"), tiny_text_model(root / "text"))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_manifest(tmp_path_factory.mktemp("raw"), rows=20)


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parquet") / "train.parquet"
    return write_parquet(path, parquet_rows(20), image_columns=("source_img", "target_img"))


def read_everything(cache: Path) -> list[dict[str, Any]]:
    """Every sample, after checking that the DataModule trains on each of them exactly once."""
    data = ImageEditDataModule(cache_dir=str(cache), batch_size=3, num_workers=0, drop_last=False)
    data.setup("fit")
    batches = list(data.train_dataloader())
    seen = sorted(i for batch in batches for i in batch["metadata"]["sample_indices"])
    dataset = ImageEditDataset(cache)
    assert seen == list(range(len(dataset)))
    assert all(batch["image_latents"].ndim == 4 for batch in batches)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("payload_format", ["pt", "safetensors"])
def test_a_manifest_cache_built_with_tiny_hf_models_loads_and_validates(
    tmp_path: Path, manifest: Path, models: tuple[dict[str, Any], dict[str, Any]], payload_format: str
) -> None:
    options = BuildOptions(payload_format=payload_format, resize=RESIZE, batch_size=4)  # type: ignore[arg-type]
    report = build_cache(tmp_path / "cache", JsonlManifestSource(manifest), *models, options)
    assert report.written == 20 and report.merged is not None and report.merged.samples == 20
    samples = read_everything(tmp_path / "cache")
    assert len(samples) == 20
    assert all(s["target_latent"].shape[0] == 4 for s in samples)
    first = samples[0]["metadata"]
    assert first["original_ids"] == {"id": "s000"}
    assert first["manifest_metadata"] == {"n": 0}
    assert [m["role"] for m in first["media"]] == ["target", "context", "context", "condition"]
    assert first["original_pixel_shapes"] == {
        "target": [24, 40],
        "contexts": [[24, 40], [32, 32]],
        "conditions": [[24, 40]],
    }
    assert "conditions" not in samples[1]["metadata"]["original_pixel_shapes"]
    assert len(samples[0]["context_latents"]) == 2 and len(samples[1]["context_latents"]) == 1
    for sample in samples:
        meta = sample["metadata"]
        assert meta["text_token_length"] == int(sample["prompt_attention_mask"].sum())
        _, h, w = sample["target_latent"].shape
        assert meta["target_token_length"] == (h // 2) * (w // 2)
        assert all(s.suffix == f".{payload_format}" for s in (tmp_path / "cache" / "samples").iterdir())


@pytest.mark.parametrize("payload_format", ["pt", "safetensors"])
def test_a_parquet_cache_built_with_tiny_hf_models_loads_and_validates(
    tmp_path: Path, parquet: Path, models: tuple[dict[str, Any], dict[str, Any]], payload_format: str
) -> None:
    source = HFDatasetSource(
        parquet,
        target_column="target_img",
        context_columns=["source_img"],
        prompt_column="instruction",
        id_column="img_id",
        metadata_columns=["turn_index"],
        hf_cache_dir=str(tmp_path / "hf"),
    )
    options = BuildOptions(payload_format=payload_format, resize=RESIZE, batch_size=8)  # type: ignore[arg-type]
    build_cache(tmp_path / "cache", source, *models, options)
    samples = read_everything(tmp_path / "cache")
    assert [s["metadata"]["original_ids"]["id"] for s in samples] == [f"m{i:03d}" for i in range(20)]
    assert samples[3]["metadata"]["manifest_metadata"] == {"turn_index": 3}
    manifest = json.loads((tmp_path / "cache" / "metadata.json").read_text())
    assert manifest["source"]["kind"] == "hf_dataset" and manifest["format"] == payload_format


def test_a_save_to_disk_dataset_with_pil_images_builds(tmp_path: Path, models: tuple[dict, dict]) -> None:
    import datasets

    columns = {
        "original_image": [drawing((32, 32), i) for i in range(3)],
        "edited_image": [drawing((32, 32), i + 9) for i in range(3)],
        "edit_prompt": ["make the sky red", "add a cat", "remove the tree"],
    }
    features = datasets.Features(
        {"original_image": datasets.Image(), "edited_image": datasets.Image(), "edit_prompt": datasets.Value("string")}
    )
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns, features=features)}).save_to_disk(
        tmp_path / "ds"
    )
    source = HFDatasetSource(tmp_path / "ds", "edited_image", ["original_image"], "edit_prompt")
    build_cache(tmp_path / "cache", source, *models, BuildOptions(resize=RESIZE))
    samples = read_everything(tmp_path / "cache")
    assert [s["metadata"]["original_ids"]["id"] for s in samples] == ["0", "1", "2"]


def test_index_order_follows_the_source_not_the_batch_size(tmp_path: Path, manifest: Path) -> None:
    source = JsonlManifestSource(manifest)
    build_cache(tmp_path / "a", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=1))
    build_cache(tmp_path / "b", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=7, num_workers=1))
    assert index_files(tmp_path / "a") == index_files(tmp_path / "b")
    records = json.loads((tmp_path / "a" / "metadata_shard_0000.json").read_text())
    assert [r["row_index"] for r in records] == list(range(20))


def test_a_stopped_build_rerun_equals_an_uninterrupted_one_when_row_indices_are_not_positions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = write_manifest(tmp_path / "raw", rows=12)
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    for position, line in enumerate(lines):
        line["metadata"]["row_index"] = 5 * (len(lines) - position)  # 60, 55, ..., 5: gaps, and backwards
    source = JsonlManifestSource(write_lines(manifest, lines))
    specs = ({"class_path": "support.builds.InterruptedImageEncoder", "init_args": {}}, DEMO_SPECS[1])
    # One image per encoder call, so the samples a rerun encodes again meet the same kernels as before.
    options = BuildOptions(resize=RESIZE, batch_size=1)
    cache = tmp_path / "stopped"
    monkeypatch.setattr(InterruptedImageEncoder, "fail_at", 12)  # in the second window of 4 samples
    with pytest.raises(RuntimeError, match="stopped in encode call 12"):
        build_cache(cache, source, *specs, options)
    assert sorted(p.name for p in (cache / "samples").iterdir()) == [f"sample_{r:08d}.pt" for r in (45, 50, 55, 60)]
    # What a kill leaves besides: a payload temporary of an unfinished sample, and a journaled payload lost.
    (cache / "samples" / ".sample_00000040.pt.abc123.tmp").write_bytes(b"half a payload")
    (cache / "samples" / "sample_00000055.pt").unlink()
    monkeypatch.setattr(InterruptedImageEncoder, "fail_at", None)
    report = build_cache(cache, source, *specs, options)
    assert (report.already_done, report.written) == (3, 9)
    assert not list((cache / "samples").glob(".*.tmp"))
    build_cache(tmp_path / "whole", source, *specs, options)
    assert index_files(cache) == index_files(tmp_path / "whole")
    same_samples(ImageEditDataset(cache), ImageEditDataset(tmp_path / "whole"))
    assert [ImageEditDataset(cache)[i]["metadata"]["row_index"] for i in range(12)] == list(range(5, 61, 5))


def test_shards_split_the_index_in_source_order(tmp_path: Path, manifest: Path) -> None:
    build_cache(tmp_path / "c", JsonlManifestSource(manifest), *DEMO_SPECS, BuildOptions(resize=RESIZE, shard_size=6))
    manifest_json = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert manifest_json["shards"] == [f"metadata_shard_{i:04d}.json" for i in range(4)]
    assert len(ImageEditDataset(tmp_path / "c")) == 20


def test_vae_latents_are_normalised_with_shift_and_scaling_factor(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    path = tiny_vae(tmp_path / "vae", scaling_factor=0.5, shift_factor=0.25)
    encoder = DiffusersVAEEncoder(str(path))
    images = to_pixels([drawing((32, 16), 1), drawing((32, 16), 2)])
    raw = AutoencoderKL.from_pretrained(path).encode(images).latent_dist.mode()
    assert encoder.spatial_factor == 2
    torch.testing.assert_close(encoder.encode(images), (raw - 0.25) * 0.5)
    torch.testing.assert_close(encoder.decode(encoder.encode(images)).shape, images.shape)


def test_vae_sample_mode_draws_from_the_latent_distribution(tmp_path: Path) -> None:
    path = tiny_vae(tmp_path / "vae")
    images = to_pixels([drawing((16, 16), 1)])
    mode = DiffusersVAEEncoder(str(path)).encode(images)
    sampled = DiffusersVAEEncoder(str(path), sampling="sample", seed=3).encode(images)
    again = DiffusersVAEEncoder(str(path), sampling="sample", seed=3).encode(images)
    assert not torch.equal(mode, sampled)
    torch.testing.assert_close(sampled, again)


def test_qwen_image_vae_uses_latents_mean_and_std(tmp_path: Path) -> None:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    mean, std = [0.1, -0.2, 0.3, 0.0], [2.0, 1.0, 0.5, 4.0]
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=mean,
        latents_std=std,
    )
    vae.save_pretrained(tmp_path / "qwen")
    encoder = DiffusersVAEEncoder(str(tmp_path / "qwen"))
    images = to_pixels([drawing((32, 16), 4)])
    raw = vae.encode(images.unsqueeze(2)).latent_dist.mode().squeeze(2)
    expected = (raw - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    assert encoder.spatial_factor == 2
    torch.testing.assert_close(encoder.encode(images), expected)


def test_text_encoder_keeps_only_real_tokens_unless_asked_to_pad(tmp_path: Path) -> None:
    path = str(tiny_text_model(tmp_path / "text"))
    trimmed = TransformersTextEncoder(path, max_sequence_length=8).encode(["make the sky red", "add a cat"])
    assert [tuple(e.shape) for e, _ in trimmed] == [(4, 16), (3, 16)]
    assert all(bool(m.all()) for _, m in trimmed)
    padded = TransformersTextEncoder(path, max_sequence_length=8, pad_to_max_length=True).encode(["add a cat"])
    embeddings, mask = padded[0]
    assert tuple(embeddings.shape) == (8, 16) and mask.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert float(embeddings[3:].abs().sum()) == 0.0


def test_the_text_encoder_reports_every_prompt_it_cuts(tmp_path: Path) -> None:
    encoder = TransformersTextEncoder(str(tiny_text_model(tmp_path / "text")), max_sequence_length=3)
    long, short = encoder.encode_prompts(["make the sky red", "add a cat"], [(), ()])
    assert tuple(long.embeddings.shape) == (3, 16) and tuple(short.embeddings.shape) == (3, 16)
    assert long.truncations == (Truncation("BertModel", 4, 3, "max_sequence_length 3"),)
    assert short.truncations == ()
    with pytest.warns(PromptTruncationWarning, match=r"prompt 'make the sky red': BertModel kept 3 of 4 tokens"):
        ((embeddings, _),) = encoder.encode(["make the sky red"])
    assert tuple(embeddings.shape) == (3, 16)


def test_a_pipeline_directory_is_read_through_subfolders(tmp_path: Path) -> None:
    tiny_vae(tmp_path / "pipe" / "vae")
    tiny_text_model(tmp_path / "pipe" / "text_encoder")
    assert DiffusersVAEEncoder(str(tmp_path / "pipe"), subfolder="vae").spatial_factor == 2
    encoder = TransformersTextEncoder(str(tmp_path / "pipe"), subfolder="text_encoder")
    assert tuple(encoder.encode(["add a dog"])[0][0].shape) == (3, 16)
