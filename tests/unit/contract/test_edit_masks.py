"""Claims about edit-region masks: a manifest `mask` (or a data set column) becomes a latent-resolution weight map."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support.builds import DEMO_SPECS, drawing, png_bytes, write_lines, write_parquet
from support.manifests import KEEP, band, build, masked_manifest

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset, collate_image_edit
from image_edit_data.contract import EDIT_MASK, Signature, validate
from image_edit_data.contract.validate import CacheFormatError
from image_edit_data.index.store import open_index
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.preprocess.encoders.base import PromptEncoding
from image_edit_data.preprocess.run.encode import encode_window, prepare
from image_edit_data.preprocess.run.mask import latent_mask
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

# Raw images are 32x32 and kept: demo latents are [4, 4, 4], one latent cell per 8x8 pixels.

LEFT_QUARTER = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 4)  # what a mask white over its left 8 columns becomes


def test_a_mask_averages_its_pixels_over_each_latent_cell() -> None:
    # White over columns 0..12 of 32: cell 0 (pixels 0..8) is all inside, cell 1 (8..16) half.
    expected = torch.tensor([[1.0, 0.5, 0.0, 0.0]] * 4)
    assert torch.equal(latent_mask(band((32, 32), 0, 12), KEEP, 8), expected)
    # An RGB mask reads as its grey level; a mask resized with its target (64 -> 32 pixels) keeps its region.
    halved = ResizePolicy("max_pixels", max_pixels=32 * 32, spatial_alignment=16)
    assert torch.equal(latent_mask(band((64, 64), 0, 24).convert("RGB"), halved, 8), expected)


def test_a_mask_follows_the_targets_centre_crop() -> None:
    presets = ResizePolicy("presets", spatial_alignment=16, presets=((32, 32),))
    # A 64x32 target covers the 32x32 preset as it is and loses 16 columns on each side to the crop.
    assert torch.equal(latent_mask(band((64, 32), 0, 16), presets, 8), torch.zeros(4, 4))
    assert torch.equal(latent_mask(band((64, 32), 16, 24), presets, 8), LEFT_QUARTER)


@pytest.fixture(scope="module")
def masked_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("masks")
    build(masked_manifest(root / "raw"), root / "cache")
    return root / "cache"


def test_a_manifest_mask_becomes_the_samples_edit_mask_in_a_bucket_of_its_own(masked_cache: Path) -> None:
    dataset = ImageEditDataset(masked_cache)
    assert dataset.get_bucket_info()["buckets"] == {
        "target=4x4x4/contexts=[4x4x4]": 2,
        "target=4x4x4/contexts=[4x4x4]/mask": 2,
    }
    masked, plain = dataset[0], dataset[2]
    assert torch.equal(masked["conditioning_tensors"][EDIT_MASK], LEFT_QUARTER)
    assert masked["conditioning_tensors"][EDIT_MASK].dtype == torch.float32
    assert masked["metadata"]["compound_bucket_signature"]["mask"] is True
    assert masked["metadata"]["conditioning_shapes"][EDIT_MASK] == [4, 4]
    assert EDIT_MASK not in plain["conditioning_tensors"]
    assert "mask" not in plain["metadata"]["compound_bucket_signature"]  # unmasked samples keep their JSON


def test_batches_carry_the_masks_and_never_mix_masked_and_unmasked_samples(masked_cache: Path) -> None:
    loader = ImageEditDataloaderConfig(cache_dir=str(masked_cache), num_workers=0, drop_last=False).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    batches = list(loader.dataloader)
    assert sorted(i for b in batches for i in b["metadata"]["sample_indices"]) == [0, 1, 2, 3]
    for batch in batches:
        indices = batch["metadata"]["sample_indices"]
        if indices[0] < 2:
            assert sorted(indices) == [0, 1]
            assert torch.equal(batch["conditioning_tensors"][EDIT_MASK], LEFT_QUARTER.expand(2, 4, 4))
        else:
            assert sorted(indices) == [2, 3] and EDIT_MASK not in batch["conditioning_tensors"]


def test_collate_refuses_a_sample_without_a_mask_in_a_batch_with_masks(masked_cache: Path) -> None:
    dataset = ImageEditDataset(masked_cache)
    with pytest.raises(ValueError, match="sample 1 has no edit_mask and sample 0 has one"):
        collate_image_edit([dataset[0], dataset[2]])
    with pytest.raises(ValueError, match="sample 1 has one edit_mask and sample 0 has none"):
        collate_image_edit([dataset[2], dataset[0]])


def test_the_stored_and_the_packed_index_keep_the_mask_in_the_signature(masked_cache: Path, tmp_path: Path) -> None:
    parsed = open_index(masked_cache, use_store=False).signatures
    assert [s.mask for s in parsed] == [False, True]
    open_index(masked_cache)  # writes the stored index when it is missing
    assert open_index(masked_cache).signatures == parsed
    assert cache_main(["pack", str(masked_cache), str(tmp_path / "packed")]) == 0
    packed = ImageEditDataset(tmp_path / "packed")
    assert packed.signatures == parsed
    assert torch.equal(packed[0]["conditioning_tensors"][EDIT_MASK], LEFT_QUARTER)


def test_the_data_monitor_keys_a_masked_batch_by_its_masked_bucket(masked_cache: Path) -> None:
    from image_edit_data.lightning.monitor import ImageEditDataMonitor, _batch_signature

    dataset = ImageEditDataset(masked_cache)
    monitor = ImageEditDataMonitor()
    monitor.use_index(dataset.signatures)
    masked, plain = collate_image_edit([dataset[0], dataset[1]]), collate_image_edit([dataset[2], dataset[3]])
    assert [monitor.bucket_id(_batch_signature(b)) for b in (plain, masked)] == [0, 1]
    assert monitor.bucket_signatures == [s.describe() for s in dataset.signatures]


def test_validate_and_inspect_count_the_masked_samples(masked_cache: Path, capsys: pytest.CaptureFixture) -> None:
    note = "2 samples with an edit mask (conditioning_tensors.edit_mask) in 1 bucket(s) marked /mask"
    assert cache_main(["validate", str(masked_cache)]) == 0
    assert note in capsys.readouterr().out.replace("\n", " ")
    assert cache_main(["inspect", str(masked_cache)]) == 0
    assert note in capsys.readouterr().out.replace("\n", " ")


def test_a_mask_of_another_size_than_its_target_or_a_second_mask_is_a_bad_sample(tmp_path: Path) -> None:
    manifest = masked_manifest(tmp_path / "raw", masked=(0,), rows=1)
    band((16, 32), 0, 8).save(tmp_path / "raw" / "images" / "mask.png")
    with pytest.raises(BadSampleError, match=r"line 1: mask image is 16x32 pixels, its target 32x32") as bad:
        build(manifest, tmp_path / "a")
    assert bad.value.kind == "misaligned image"
    # A target the resize policy refuses is reported as such, before its mask is looked at.
    drawing((40, 32), 0).save(tmp_path / "raw" / "images" / "0_tgt.png")
    with pytest.raises(BadSampleError, match=r"line 1: target image is 40x32 pixels, not a multiple of 16"):
        build(manifest, tmp_path / "b")
    line = json.loads(manifest.read_text())
    line["media"].append({"role": "mask", "file_name": "images/mask.png"})
    write_lines(manifest, [line])
    with pytest.raises(BadSampleError, match=r"line 1: media: expected at most one entry with role 'mask', got 2"):
        JsonlManifestSource(manifest).read(0)


def masked_payload(mask: Any) -> dict[str, Any]:
    """A valid masked payload of target [4, 4, 4] and one context, its edit mask replaced by `mask`."""
    return {
        "target_latent": torch.zeros(4, 4, 4),
        "context_latents": [torch.zeros(4, 4, 4)],
        "prompt_embeddings": torch.zeros(3, 8),
        "prompt_attention_mask": torch.ones(3, dtype=torch.long),
        "conditioning_tensors": {EDIT_MASK: mask},
        "metadata": {
            "original_ids": {"id": "a"},
            "target_spatial_shape": [4, 4],
            "context_spatial_shapes": [[4, 4]],
            "compound_bucket_signature": {"target": [4, 4, 4], "contexts": [[4, 4, 4]], "mask": True},
            "conditioning_shapes": {EDIT_MASK: list(getattr(mask, "shape", []))},
        },
    }


MASKED = Signature((4, 4, 4), ((4, 4, 4),), mask=True)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(2, 2), r"edit_mask: expected shape \[4, 4\] \(the target latent's \[H, W\]\), got \[2, 2\]"),
        (torch.ones(4, 4, dtype=torch.int8), r"edit_mask: expected a floating-point dtype \(float32\), got torch.int8"),
        (torch.full((4, 4), 2.0), r"edit_mask: expected values in \[0, 1\] \(1 = edited\), got values from 2 to 2"),
        (torch.full((4, 4), float("nan")), r"edit_mask: expected finite values in \[0, 1\], got 16 NaN and 0 Inf"),
    ],
)
def test_the_contract_refuses_a_mask_of_the_wrong_shape_type_or_range(mask: torch.Tensor, message: str) -> None:
    checked = validate.payload(masked_payload(LEFT_QUARTER), MASKED, "x.pt", None)
    assert torch.equal(checked["conditioning_tensors"][EDIT_MASK], LEFT_QUARTER)
    with pytest.raises(CacheFormatError, match=rf"x.pt: conditioning_tensors\.{message}"):
        validate.payload(masked_payload(mask), MASKED, "x.pt", None)


def test_an_index_that_says_masked_for_an_unmasked_payload_is_refused() -> None:
    unmasked = masked_payload(LEFT_QUARTER)
    unmasked["conditioning_tensors"] = {}
    expected = (
        r"tensor shapes target=4x4x4/contexts=\[4x4x4\] do not match metadata shard signature "
        r"target=4x4x4/contexts=\[4x4x4\]/mask$"
    )
    with pytest.raises(CacheFormatError, match=expected):
        validate.payload(unmasked, MASKED, "x.pt", None)
    with pytest.raises(CacheFormatError, match=r"compound_bucket_signature.mask: expected true or false, got 1"):
        validate.signature({"target": [4, 4, 4], "contexts": [], "mask": 1}, "x.json", "compound_bucket_signature")


def test_a_data_set_mask_column_such_as_magicbrushs_mask_img_is_read(tmp_path: Path) -> None:
    from image_edit_data.preprocess.sources.hf import HFDatasetSource

    def cell(image: Image.Image) -> dict[str, Any]:
        return {"bytes": png_bytes(image), "path": None}

    columns = {
        "source_img": [cell(drawing((32, 32), i)) for i in range(2)],
        "target_img": [cell(drawing((32, 32), i + 9)) for i in range(2)],
        "mask_img": [cell(band((32, 32), 0, 8).convert("RGB")), None],  # an empty cell: that row is unmasked
        "instruction": ["make it red", "make it blue"],
    }
    path = write_parquet(tmp_path / "pq" / "rows.parquet", columns)
    source = HFDatasetSource(
        path, "target_img", ["source_img"], "instruction", hf_cache_dir=str(tmp_path / "hf"), mask_column="mask_img"
    )
    assert source.columns.to_json()["mask_column"] == "mask_img"
    assert "mask_column" not in HFDatasetSource(path, "target_img", ["source_img"], "instruction").columns.to_json()
    encoders = ["--hf-cache-dir", str(tmp_path / "hf"), "--image-encoder", DEMO_SPECS[0]["class_path"]]
    encoders += ["--image-encoder.latent_channels", "4"]
    encoders += ["--text-encoder", DEMO_SPECS[1]["class_path"], "--text-encoder.dim", "8"]
    args = ["build", str(tmp_path / "cache"), "--dataset", str(path), "--mask-column", "mask_img", *encoders]
    assert cache_main([*args, "--resize", "none", "--spatial-alignment", "16", "--quiet"]) == 0
    dataset = ImageEditDataset(tmp_path / "cache")
    assert torch.equal(dataset[0]["conditioning_tensors"][EDIT_MASK], LEFT_QUARTER)
    assert EDIT_MASK not in dataset[1]["conditioning_tensors"]
    # The same columns as text-to-image rows with masks: no context column, asked for on the command line.
    args = ["build", str(tmp_path / "rows"), "--dataset", str(path), "--mask-column", "mask_img", *encoders]
    args += ["--context-columns", "[]", "--allow-no-context", "--resize", "none", "--spatial-alignment", "16"]
    assert cache_main([*args, "--quiet"]) == 0
    assert ImageEditDataset(tmp_path / "rows").get_bucket_info()["buckets"] == {
        "target=4x4x4/contexts=[]": 1,
        "target=4x4x4/contexts=[]/mask": 1,
    }


class PromptsWithAnEditMask:
    """A prompt encoder whose conditioning tensor takes the name the cache keeps for masks."""

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        return [PromptEncoding(torch.zeros(2, 8), torch.ones(2), {EDIT_MASK: torch.zeros(4, 4)}) for _ in prompts]


def test_an_encoder_conditioning_tensor_named_edit_mask_is_refused(tmp_path: Path) -> None:
    from image_edit_data.preprocess.encoders.demo import DemoImageEncoder

    source = JsonlManifestSource(masked_manifest(tmp_path / "raw", masked=(), rows=1))
    prepared = prepare(source, 0, KEEP, 8)
    assert not isinstance(prepared, BadSampleError)
    with pytest.raises(ValueError, match=r"returned a conditioning tensor named 'edit_mask', the name the cache"):
        encode_window([prepared], DemoImageEncoder(latent_channels=4), PromptsWithAnEditMask(), 1, 8)
