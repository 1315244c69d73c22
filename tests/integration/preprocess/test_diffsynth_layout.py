"""Claims about building caches from DiffSynth-Studio's metadata (CSV, JSON, JSONL with a base path) as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.peers import assert_same_cache, build, image, manifest

from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.preprocess.sources.diffsynth import DiffSynthSource


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """DiffSynth's example layout: images beside (and below) the metadata file."""
    root = tmp_path / "data"
    for i in range(3):
        image(root / f"image_{i}.jpg", i)
        image(root / "edit" / f"in_{i}.png", 10 + i)
    image(root / "edit" / "ref.png", 20)
    return root


def test_diffsynth_json_jsonl_and_csv_build_the_cache_of_their_manifest(tmp_path: Path, base: Path) -> None:
    rows = [
        {"image": "image_0.jpg", "prompt": "make it red", "edit_image": "edit/in_0.png", "tag": "a"},
        {"image": "image_1.jpg", "prompt": "add a cat", "edit_image": ["edit/in_1.png", "edit/ref.png"], "tag": "b"},
        {"image": "image_2.jpg", "prompt": "remove it", "edit_image": ["edit/in_2.png"], "tag": "c"},
    ]
    (base / "metadata.json").write_text(json.dumps(rows))
    (base / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [
        (
            r["image"],
            r["prompt"],
            base / r["image"],
            [base / p for p in ([r["edit_image"]] if isinstance(r["edit_image"], str) else r["edit_image"])],
        )
        for r in rows
    ]
    reference = build(
        tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected, [{"tag": r["tag"]} for r in rows]))
    )
    for name in ("metadata.json", "metadata.jsonl"):
        out = build(tmp_path / name, "--diffsynth-metadata", str(base / name), "--base-path", str(base))
        assert_same_cache(out, reference)
    # CSV holds no lists: one context per row, and the base path defaults to the file's directory.
    (base / "metadata.csv").write_text('image,prompt,edit_image,tag\nimage_0.jpg,"make it red",edit/in_0.png,a\n')
    single = build(tmp_path / "ref1", "--manifest", str(manifest(tmp_path / "m1.jsonl", expected[:1], [{"tag": "a"}])))
    assert_same_cache(build(tmp_path / "csv", "--diffsynth-metadata", str(base / "metadata.csv")), single)


def test_flux_kontext_metadata_reads_its_context_key(tmp_path: Path, base: Path) -> None:
    (base / "metadata.csv").write_text("image,kontext_images,prompt\nimage_0.jpg,edit/in_0.png,make it red\n")
    source = DiffSynthSource(base / "metadata.csv", context_key="kontext_images")
    assert [c.size for c in source.read(0).sample.contexts] == [(24, 40)]
    with pytest.raises(
        ValueError,
        match=r"no row has the context key 'edit_image'; its keys are \['image', 'kontext_images', 'prompt'\]",
    ):
        DiffSynthSource(base / "metadata.csv")


def test_bad_diffsynth_rows_are_bad_samples_naming_file_and_row(tmp_path: Path, base: Path) -> None:
    (base / "edit" / "broken.png").write_bytes(b"garbage")
    rows = [
        '{"image": "image_0.jpg", "prompt": "ok", "edit_image": "edit/in_0.png"}',
        '{"prompt": "no target", "edit_image": "edit/in_0.png"}',
        '{"image": "image_1.jpg", "prompt": "broken", "edit_image": "edit/broken.png"}',
        '{"image": "image_1.jpg", "prompt": "gone", "edit_image": ["edit/missing.png"]}',
        '{"image": "image_2.jpg", "prompt": "two", "edit_image": ["edit/in_1.png", "edit/in_2.png"]}',
        '{"image": "image_2.jpg", "prompt": "remote", "edit_image": "https://example.com/x.png"}',
        "{not json",
    ]
    (base / "m.jsonl").write_text("\n".join(rows) + "\n")
    source = DiffSynthSource(base / "m.jsonl", controls_per_sample=1)
    messages = {}
    for position in range(1, len(source)):
        with pytest.raises(BadSampleError) as error:
            source.read(position)
        messages[error.value.location.rsplit(" ", 1)[1]] = error.value.problem
    assert source.read(0).sample.prompt == "ok"
    assert "image: expected a file path, got None" in messages["2"]
    assert "context 0: file" in messages["3"] and "is not a readable image" in messages["3"]
    assert "edit/missing.png' does not exist" in messages["4"]
    assert "edit_image: expected 1 image(s), got 2" in messages["5"]
    assert "is a URL; nothing is downloaded" in messages["6"]
    assert "not valid JSON" in messages["7"]
    (base / "m.csv").write_text("image,prompt,edit_image\nimage_0.jpg,x,\"['edit/in_0.png', 'edit/ref.png']\"\n")
    with pytest.raises(BadSampleError, match=r"m\.csv row 0 \(line 2\): edit_image: .* looks like a list"):
        DiffSynthSource(base / "m.csv").read(0)
    build(tmp_path / "stop", "--diffsynth-metadata", str(base / "m.jsonl"), "--controls-per-sample", "1", expect=1)


def test_a_csv_saved_by_excel_with_a_byte_order_mark_reads_as_pandas_reads_it(tmp_path: Path, base: Path) -> None:
    # DiffSynth's CSV example (docs/en/API_Reference/core/data.md: image, a quoted prompt) with the edit_image column
    # its Qwen-Image-Edit training reads (--data_file_keys "image,edit_image"), saved as Excel's "CSV UTF-8" saves:
    # a byte-order mark and CRLF line ends.
    text = (
        'image,prompt,edit_image\r\nimage_0.jpg,"make it red, then blue",edit/in_0.png\r\n'
        "image_1.jpg,add a cat,edit/in_1.png\r\n"
    )
    (base / "metadata.csv").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    expected = [
        ("image_0.jpg", "make it red, then blue", base / "image_0.jpg", [base / "edit" / "in_0.png"]),
        ("image_1.jpg", "add a cat", base / "image_1.jpg", [base / "edit" / "in_1.png"]),
    ]
    reference = build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected, [{}, {}])))
    assert_same_cache(build(tmp_path / "csv", "--diffsynth-metadata", str(base / "metadata.csv")), reference)
    # DiffSynth's JSON readers (json.load, json.loads per line) refuse the mark; so does this route, naming the file.
    (base / "metadata.json").write_bytes(
        b"\xef\xbb\xbf" + b'[{"image": "image_0.jpg", "prompt": "x", "edit_image": "a"}]'
    )
    with pytest.raises(ValueError, match=r"metadata\.json: not valid JSON \(Unexpected UTF-8 BOM"):
        DiffSynthSource(base / "metadata.json")
