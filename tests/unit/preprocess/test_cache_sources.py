"""Claims about reading raw edit examples (JSONL manifests, local HF data sets) and resizing them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.builds import DEMO_SPECS, drawing, parquet_rows, png_bytes, write_lines, write_manifest, write_parquet

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.base import BadSampleError, SequenceSource
from image_edit_data.preprocess.sources.demo import DemoSource
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource
from image_edit_data.preprocess.sources.records import RawEditSample

RESIZE = ResizePolicy("max_pixels", max_pixels=32 * 32, spatial_alignment=16, upscale=True)


def entry(i: int, **changes: Any) -> dict[str, Any]:
    """A valid manifest line for the images `write_manifest` drew, with `changes` applied."""
    line = {
        "id": f"s{i:03d}",
        "prompt": "make the sky red",
        "media": [
            {"role": "target", "file_name": f"images/{i}_tgt.png"},
            {"role": "context", "file_name": f"images/{i}_src.png"},
        ],
    }
    return line | changes


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    """A directory holding the images of a 4-row manifest."""
    write_manifest(tmp_path / "raw", rows=4)
    return tmp_path / "raw"


def build(source: Any, out: Path, **options: Any) -> Any:
    return build_cache(out, source, *DEMO_SPECS, BuildOptions(resize=RESIZE, **options))


def test_manifest_keeps_context_order_and_skips_condition_media(raw: Path) -> None:
    line = entry(0)
    line["media"] = [
        {"role": "context", "file_name": "images/1_src.png"},
        {"role": "condition", "file_name": "images/2_src.png"},
        {"role": "target", "file_name": "images/0_tgt.png"},
        {"role": "context", "file_name": "images/0_ref.png"},
    ]
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", ["", line, "  "]))
    record = source.read(0)
    assert len(source) == 1 and record.location.endswith("m.jsonl line 2")
    assert [c.size for c in record.sample.contexts] == [(24, 40), (32, 32)]
    assert record.sample.target.size == (40, 24)
    assert [m["role"] for m in record.media] == ["context", "condition", "target", "context"]


BAD_LINES = [
    ('{"id": "x", "prompt": ', "line 2: not valid JSON"),
    ([1, 2], "line 2: expected a JSON object, got list"),
    ({"prompt": "p", "media": []}, r"line 2: id: expected a non-empty string or integer, got None"),
    (entry(1, prompt="   "), r"line 2: prompt: expected non-empty text, got '   '"),
    (entry(1, prompt=None), r"line 2: prompt: expected non-empty text, got None"),
    (
        entry(1, media=[{"role": "context", "file_name": "images/1_src.png"}]),
        "line 2: media: expected exactly one entry with role 'target', got 0",
    ),
    (
        entry(1, media=[{"role": "target", "file_name": "images/1_tgt.png"}]),
        "line 2: media: expected at least one entry with role 'context', got none",
    ),
    (
        entry(1, media=[{"role": "depth", "file_name": "x.png"}]),
        r"line 2: media\[0\].role: expected one of target, "
        "context, condition, mask, got 'depth'",
    ),
    (entry(0), "line 2: id: 's000' is already used on line 1"),
    (entry(1, metadata=[1]), "line 2: metadata: expected an object, got list"),
    (entry(1, metadata={"row_index": "7"}), r"line 2: metadata.row_index: expected an integer >= 0, got '7'"),
    (entry(1, metadata={"row_index": True}), r"line 2: metadata.row_index: expected an integer >= 0, got True"),
    (entry(1, metadata={"row_index": -1}), r"line 2: metadata.row_index: expected an integer >= 0, got -1"),
    (entry(1, metadata={"row_index": 0}), r"line 2: metadata.row_index: 0 is already the row index of line 1"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_LINES)
def test_a_bad_manifest_line_stops_the_build_naming_its_line(raw: Path, tmp_path: Path, bad: Any, message: str) -> None:
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [entry(0), bad, entry(2)]))
    with pytest.raises(BadSampleError, match=message):
        build(source, tmp_path / "cache")
    assert not (tmp_path / "cache" / "metadata.json").exists()


def test_a_missing_image_names_the_file_and_line(raw: Path, tmp_path: Path) -> None:
    line = entry(1)
    line["media"][1]["file_name"] = "images/nope.png"
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [entry(0), line]))
    with pytest.raises(BadSampleError, match=r"m.jsonl line 2: media\[1\].file_name: 'images/nope.png' does not exist"):
        build(source, tmp_path / "cache")


def test_an_unreadable_image_is_reported(raw: Path, tmp_path: Path) -> None:
    (raw / "images" / "broken.png").write_bytes(b"not a png at all")
    line = entry(1)
    line["media"][0]["file_name"] = "images/broken.png"
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [line]))
    with pytest.raises(
        BadSampleError, match=r"line 1: media\[0\].file_name: file .*broken.png' is not a readable image"
    ):
        build(source, tmp_path / "cache")


def test_image_paths_may_not_leave_the_manifest_directory(raw: Path, tmp_path: Path) -> None:
    drawing((32, 32), 0).save(tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", raw / "images" / "link.png")
    escape = entry(0)
    escape["media"][1]["file_name"] = "../outside.png"
    linked = entry(1)
    linked["media"][1]["file_name"] = "images/link.png"
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [escape, linked]))
    with pytest.raises(BadSampleError, match=r"line 1: media\[1\].file_name: '../outside.png' resolves to .* outside"):
        source.read(0)
    with pytest.raises(BadSampleError, match=r"line 2: media\[1\].file_name: 'images/link.png' resolves to .* outside"):
        source.read(1)


def test_skipped_bad_samples_are_counted_with_reasons(raw: Path, tmp_path: Path) -> None:
    missing = entry(1)
    missing["media"][0]["file_name"] = "images/gone.png"
    lines = [entry(0), missing, entry(2, prompt=""), entry(3), entry(0)]
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", lines))
    report = build(source, tmp_path / "cache", on_bad_sample="skip")
    assert report.written == 2
    assert report.skipped == {"missing image": 1, "empty prompt": 1, "duplicate id": 1}
    manifest = json.loads((tmp_path / "cache" / "metadata.json").read_text())
    assert manifest["counts"] == {
        "rows": 5,
        "samples": 2,
        "skipped": 3,
        "skipped_by_reason": {"duplicate id": 1, "empty prompt": 1, "missing image": 1},
    }
    assert [s["row_index"] for s in manifest["skipped_samples"]] == [1, 2, 4]
    assert manifest["skipped_samples"][2]["problem"] == "id: 's000' is already used on line 1"
    assert [ImageEditDataset(tmp_path / "cache")[i]["metadata"]["row_index"] for i in range(2)] == [0, 3]


def test_metadata_row_index_names_the_payloads_and_orders_the_index_as_in_nemo(raw: Path, tmp_path: Path) -> None:
    extra = {"role": "context", "file_name": "images/0_ref.png", "caption": "kept out of the payload"}
    first = entry(0, metadata={"row_index": 7})
    first["media"].append(extra)
    lines = [first, entry(1, metadata={"row_index": 2}), entry(2, prompt="", metadata={"row_index": 5}), entry(3)]
    build(JsonlManifestSource(write_lines(raw / "m.jsonl", lines)), tmp_path / "cache", on_bad_sample="skip")
    index = json.loads((tmp_path / "cache" / "metadata_shard_0000.json").read_text())
    # Line 4 gives no row index, so its position (3) is its row index.
    assert [(r["row_index"], r["original_id"]) for r in index] == [(2, "s001"), (3, "s003"), (7, "s000")]
    assert [r["cache_file"] for r in index] == [f"samples/sample_{i:08d}.pt" for i in (2, 3, 7)]
    (skipped,) = json.loads((tmp_path / "cache" / "metadata.json").read_text())["skipped_samples"]
    assert skipped["row_index"] == 5 and skipped["location"].endswith("m.jsonl line 3")
    dataset = ImageEditDataset(tmp_path / "cache")
    assert [dataset[i]["metadata"]["row_index"] for i in range(3)] == [2, 3, 7]
    assert dataset[2]["metadata"]["media"][-1] == {"role": "context", "file_name": "images/0_ref.png"}


def test_a_line_without_a_row_index_may_not_take_a_position_an_earlier_line_claimed(raw: Path) -> None:
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [entry(0, metadata={"row_index": 1}), entry(1)]))
    assert source.row_index(0) == 1
    message = r"line 2: metadata.row_index: not given, so the position 1 is already the row index of line 1"
    with pytest.raises(BadSampleError, match=message):
        source.read(1)


def test_a_stopped_build_resumes_with_skip_after_the_fix_is_chosen(raw: Path, tmp_path: Path) -> None:
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [entry(0), entry(1, prompt=""), entry(2)]))
    with pytest.raises(BadSampleError):
        build(source, tmp_path / "cache")
    report = build(source, tmp_path / "cache", on_bad_sample="skip")
    assert report.merged is not None and (report.merged.samples, report.merged.skipped) == (2, 1)


def test_resize_none_refuses_misaligned_images(raw: Path, tmp_path: Path) -> None:
    source = JsonlManifestSource(write_lines(raw / "m.jsonl", [entry(0)]))
    with pytest.raises(BadSampleError, match="line 1: target image is 40x24 pixels, not a multiple of 16"):
        build_cache(
            tmp_path / "c", source, *DEMO_SPECS, BuildOptions(resize=ResizePolicy("none", spatial_alignment=16))
        )


def test_hf_source_reads_a_column_mapping_with_every_image_form(tmp_path: Path) -> None:
    import datasets

    from image_edit_data.preprocess.sources.hf import HFDatasetSource

    image = drawing((32, 32), 3)
    columns = {
        "pil": [image] * 3,
        "raw": [png_bytes(image)] * 3,
        "struct": [{"bytes": png_bytes(image), "path": "ignored.png"}] * 3,
        "extra": [[png_bytes(image), png_bytes(image)], [png_bytes(image)], [png_bytes(image)]],
        "text": ["a", "b", "c"],
    }
    dataset = datasets.Dataset.from_dict(columns).cast_column("pil", datasets.Image())
    dataset.save_to_disk(tmp_path / "ds")
    source = HFDatasetSource(tmp_path / "ds", "pil", ["raw", "struct", "extra"], "text")
    assert [len(source.read(i).sample.contexts) for i in range(3)] == [4, 3, 3]
    assert all(c.size == (32, 32) for c in source.read(0).sample.contexts)
    assert source.read(2).sample.sample_id == "2"


HF_BAD_ROWS = [
    ({"instruction": ""}, "empty prompt", r"row 1: instruction: expected non-empty text, got ''"),
    ({"target_img": None}, "no target", r"row 1: target_img: expected an image, got None"),
    ({"source_img": None}, "no context", r"row 1: source_img: expected a context image, got None"),
    (
        {"source_img": {"bytes": b"junk", "path": None}},
        "unreadable image",
        r"row 1: source_img: bytes is not a "
        "readable image",
    ),
    ({"img_id": "m000"}, "duplicate id", r"row 1: img_id: id is already used by row 0"),
]


@pytest.mark.parametrize(("change", "kind", "message"), HF_BAD_ROWS)
def test_a_bad_data_set_row_is_reported_with_its_row(tmp_path: Path, change: dict, kind: str, message: str) -> None:
    from image_edit_data.preprocess.sources.hf import HFDatasetSource

    columns = parquet_rows(3)
    for name, value in change.items():
        columns[name][1] = value
    path = write_parquet(tmp_path / "d" / "x.parquet", columns)
    source = HFDatasetSource(
        path.parent, "target_img", ["source_img"], "instruction", id_column="img_id", hf_cache_dir=str(tmp_path / "hf")
    )
    with pytest.raises(BadSampleError, match=message) as caught:
        build(source, tmp_path / "cache")
    assert caught.value.kind == kind
    source.read(0)


def test_hf_source_refuses_unknown_columns_and_splits(tmp_path: Path) -> None:
    import datasets

    from image_edit_data.preprocess.sources.hf import HFDatasetSource

    path = write_parquet(tmp_path / "x.parquet", parquet_rows(2))
    with pytest.raises(ValueError, match=r"columns \['edited_image'\] not found; the data set has"):
        HFDatasetSource(path, "edited_image", ["source_img"], "instruction", hf_cache_dir=str(tmp_path / "hf"))
    rows = datasets.Dataset.from_dict({"a": [1]})
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]; choose one with --split"):
        HFDatasetSource(tmp_path / "dd", "a", ["a"], "a")
    with pytest.raises(ValueError, match=r"split: expected one of \['test', 'train'\], got 'dev'"):
        HFDatasetSource(tmp_path / "dd", "a", ["a"], "a", split="dev")
    assert len(HFDatasetSource(tmp_path / "dd", "a", ["a"], "a", split="test")) == 1
    rows.save_to_disk(tmp_path / "one")  # one Dataset without a split name: the datasets library's train
    assert HFDatasetSource(tmp_path / "one", "a", ["a"], "a", split="train").split == "train"
    with pytest.raises(ValueError, match=r"split: 'test' asked for, but the data set has no split names"):
        HFDatasetSource(tmp_path / "one", "a", ["a"], "a", split="test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .parquet files here"):
        HFDatasetSource(tmp_path / "empty", "a", ["a"], "a")


def test_sequence_sources_refuse_empty_prompts_and_leave_missing_contexts_to_the_build() -> None:
    image = Image.new("RGB", (16, 16))
    source = SequenceSource(
        [RawEditSample("a", " ", image, (image,)), RawEditSample("b", "p", image, ())], {"kind": "list"}
    )
    with pytest.raises(BadSampleError, match=r"list sample 0: prompt: expected text, got ' '"):
        source.read(0)
    assert source.read(1).sample.contexts == ()  # a text-to-image row: the build refuses it unless asked
    assert source.read(1).missing_context == "contexts: expected at least one context image, got none"
    assert SequenceSource(DemoSource(3), {"kind": "demo"}).describe() == {"kind": "demo", "rows": 3}


def test_max_pixels_keeps_the_aspect_ratio_within_the_budget_on_aligned_sides() -> None:
    policy = ResizePolicy("max_pixels", max_pixels=64 * 64, spatial_alignment=32)
    for size in [(100, 50), (1000, 300), (640, 480), (33, 700), (64, 64)]:
        width, height = policy.output_size(size, 8)
        assert width % 32 == 0 and height % 32 == 0 and width * height <= 64 * 64
    assert policy.output_size((100, 50), 8) == (64, 32)
    assert policy.output_size((20, 20), 8) == (32, 32)  # never below one aligned cell
    assert policy.output_size((10_000, 10), 8) == (128, 32)
    upscaling = ResizePolicy("max_pixels", max_pixels=64 * 64, spatial_alignment=16, upscale=True)
    assert upscaling.output_size((20, 10), 8) == (80, 48)
    assert ResizePolicy(upscale=True).output_size((1024, 768), 8) == (1152, 864)
    assert ResizePolicy(spatial_alignment=16).alignment(32) == 32  # also a multiple of the encoder's factor


def test_presets_pick_the_closest_aspect_ratio_and_crop_to_it() -> None:
    policy = ResizePolicy("presets", presets=((64, 64), (96, 32), (32, 96)), spatial_alignment=32)
    assert policy.output_size((300, 100), 8) == (96, 32)
    assert policy.output_size((100, 310), 8) == (32, 96)
    assert policy.output_size((120, 100), 8) == (64, 64)
    assert policy.apply(Image.new("RGB", (300, 90)), 8).size == (96, 32)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (ResizePolicy("presets", presets=((64, 48),)), r"presets\[0\]: expected positive multiples of 32, got 64x48"),
        (ResizePolicy("presets"), "presets: expected at least one"),
        (ResizePolicy(max_pixels=100), r"max_pixels: expected at least 1024 \(one 32x32 cell\), got 100"),
        (ResizePolicy(spatial_alignment=0), "spatial_alignment: expected a positive integer, got 0"),
    ],
)
def test_impossible_resize_settings_are_refused(policy: ResizePolicy, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy.check(8)
