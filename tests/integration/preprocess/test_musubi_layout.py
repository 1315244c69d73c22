"""Claims about building caches from musubi-tuner's dataset config (TOML) as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.peers import assert_same_cache, build, image, manifest, text

from image_edit_data import ImageEditDataModule, ImageEditDataset
from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.preprocess.sources.musubi import read_config


def edit_directory(root: Path) -> tuple[Path, Path]:
    """musubi's control layout: targets with .txt captions, controls matched by name (several by _<n>).

    `d_1.png` is a target of its own, so musubi (longer names first) gives it `d_1.png` and `d_1_0.png`
    and leaves `d.png` alone to `d.png`.
    """
    images, controls = root / "images", root / "controls"
    for seed, name in enumerate(["a.png", "b.jpg", "c.png", "d.png", "d_1.png"]):
        image(images / name, seed)
        text(images / (name.rsplit(".", 1)[0] + ".txt"), f"  edit {name}\n")
    image(controls / "a.png", 10)
    image(controls / "b_0.png", 11)  # b: two controls, numbered
    image(controls / "b_1.jpg", 12)
    image(controls / "c.jpg", 13)  # another extension than its target
    image(controls / "c_0001.png", 14)  # after the unnumbered one, four digits
    image(controls / "d.png", 15)
    image(controls / "d_1.png", 16)
    image(controls / "d_1_0.png", 17)
    return images, controls


def toml(path: Path, body: str) -> Path:
    path.write_text(body, encoding="utf-8")
    return path


def test_a_musubi_control_directory_builds_the_cache_of_its_manifest(tmp_path: Path) -> None:
    images, controls = edit_directory(tmp_path)
    config = toml(
        tmp_path / "dataset.toml",
        f'[general]\ncaption_extension = ".txt"\nresolution = [960, 544]\n\n[[datasets]]\n'
        f'image_directory = "{images}"\ncontrol_directory = "{controls}"\n',
    )
    expected = [
        ("a", "edit a.png", images / "a.png", [controls / "a.png"]),
        ("b", "edit b.jpg", images / "b.jpg", [controls / "b_0.png", controls / "b_1.jpg"]),
        ("c", "edit c.png", images / "c.png", [controls / "c.jpg", controls / "c_0001.png"]),
        ("d", "edit d.png", images / "d.png", [controls / "d.png"]),
        ("d_1", "edit d_1.png", images / "d_1.png", [controls / "d_1.png", controls / "d_1_0.png"]),
    ]
    built = build(tmp_path / "out", "--musubi-config", str(config))
    reference = build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected)))
    assert_same_cache(built / "0_images", reference)
    assert [s["metadata"]["media"][0]["file_name"] for s in ImageEditDataset(reference)] == [
        str(e[2]) for e in expected
    ]


def test_a_musubi_jsonl_builds_the_cache_of_its_manifest(tmp_path: Path) -> None:
    images, controls = edit_directory(tmp_path)
    lines = [
        {"image_path": str(images / "a.png"), "control_path": str(controls / "a.png"), "caption": "one "},
        # keys out of order and a gap: musubi orders by number and closes the gap
        {
            "caption": "two",
            "control_path_2": str(controls / "b_1.jpg"),
            "image_path": str(images / "b.jpg"),
            "control_path_0": str(controls / "b_0.png"),
        },
    ]
    jsonl = tmp_path / "edits.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = toml(tmp_path / "dataset.toml", f'[[datasets]]\nimage_jsonl_file = "{jsonl}"\nnum_repeats = 3\n')
    expected = [
        (str(images / "a.png"), "one ", images / "a.png", [controls / "a.png"]),
        (str(images / "b.jpg"), "two", images / "b.jpg", [controls / "b_0.png", controls / "b_1.jpg"]),
    ]
    built = build(tmp_path / "out", "--musubi-config", str(config), "--dataset-index", "0")
    reference = build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected)))
    assert_same_cache(built, reference)


def test_a_musubi_config_with_several_datasets_builds_one_cache_each_and_a_mixture_with_its_repeats(
    tmp_path: Path,
) -> None:
    images, controls = edit_directory(tmp_path)  # 5 samples, num_repeats 2
    small = tmp_path / "small"
    for i in range(2):  # 2 samples, num_repeats 1 (the default)
        image(small / "img" / f"s{i}.png", 20 + i)
        image(small / "ctl" / f"s{i}.png", 30 + i)
        text(small / "img" / f"s{i}.caption", f"small {i}")
    config = toml(
        tmp_path / "dataset.toml",
        f'[general]\ncaption_extension = ".txt"\n\n[[datasets]]\nimage_directory = "{images}"\n'
        f'control_directory = "{controls}"\nnum_repeats = 2\n\n[[datasets]]\nimage_directory = "{small / "img"}"\n'
        f'control_directory = "{small / "ctl"}"\ncaption_extension = ".caption"\n',
    )
    out = build(tmp_path / "out", "--musubi-config", str(config))
    mixture = yaml.safe_load((out / "mixture.yaml").read_text())["data"]
    assert mixture["samples_per_epoch"] == 5 * 2 + 2 * 1
    assert [(s["name"], s["weight"]) for s in mixture["sources"]] == [("0_images", 10), ("1_img", 2)]
    data = ImageEditDataModule(**mixture, batch_size=2, num_workers=0, drop_last=False, shuffle=False)
    data.setup("fit")
    drawn = [name for batch in data.train_dataloader() for name in batch["metadata"]["sources"]]
    assert (drawn.count("0_images"), drawn.count("1_img")) == (10, 2)  # len x num_repeats, as musubi's epoch


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    images, controls = edit_directory(tmp_path)
    config = toml(
        tmp_path / "dataset.toml",
        f'[[datasets]]\nimage_directory = "{images}"\ncontrol_directory = "{controls}"\ncaption_extension = ".txt"\n',
    )
    return images, controls, config


def problems(config: Path, controls_per_sample: int | None = None) -> dict[str, str]:
    """{location: problem} of every position that cannot be read."""
    source = read_config(config, controls_per_sample)[0].source
    found = {}
    for position in range(len(source)):
        try:
            source.read(position)
        except BadSampleError as error:
            found[error.location] = error.problem
    return found


def test_a_target_without_its_control_is_a_bad_sample_naming_it(layout: tuple[Path, Path, Path]) -> None:
    images, controls, config = layout
    (controls / "a.png").unlink()
    found = problems(config)
    assert list(found) == [str(images / "a.png")] and "no control image for a.png" in found[str(images / "a.png")]


def test_a_control_without_its_target_is_reported_after_the_samples(layout: tuple[Path, Path, Path]) -> None:
    _images, controls, config = layout
    image(controls / "A_0.png", 40)  # the case differs: musubi pairs names case-sensitively
    found = problems(config)
    assert list(found) == [str(controls / "A_0.png")]
    assert "matches no target" in found[str(controls / "A_0.png")]
    assert read_config(config)[0].source.location(5) == str(controls / "A_0.png")  # after the 5 samples


def test_a_missing_caption_stops_the_build_naming_the_file_and_skip_leaves_musubis_set(
    tmp_path: Path, layout: tuple[Path, Path, Path]
) -> None:
    images, _controls, config = layout
    (images / "c.txt").unlink()
    assert "caption file" in problems(config)[str(images / "c.png")]
    build(tmp_path / "stop", "--musubi-config", str(config), expect=1)
    out = build(tmp_path / "skip", "--musubi-config", str(config), "--on-bad-sample", "skip")
    assert [s["metadata"]["original_ids"]["id"] for s in ImageEditDataset(out / "0_images")] == ["a", "b", "d", "d_1"]
    skipped = json.loads((out / "0_images" / "metadata.json").read_text())["skipped_samples"]
    assert [s["location"] for s in skipped] == [str(images / "c.png")]


def test_an_unreadable_image_is_a_bad_sample_naming_it(layout: tuple[Path, Path, Path]) -> None:
    images, controls, config = layout
    (controls / "b_1.jpg").write_bytes(b"not an image")
    found = problems(config)
    assert list(found) == [str(images / "b.jpg")] and "is not a readable image" in found[str(images / "b.jpg")]


def test_another_number_of_controls_than_asked_is_a_bad_sample(layout: tuple[Path, Path, Path]) -> None:
    images, _controls, config = layout
    found = problems(config, controls_per_sample=1)  # FLUX.1 Kontext: musubi would keep the first silently
    assert sorted(found) == sorted(str(images / n) for n in ("b.jpg", "c.png", "d_1.png"))
    assert "expected 1 control image(s) for b.jpg, found 2: b_0.png, b_1.jpg" in found[str(images / "b.jpg")]


def test_names_that_differ_only_in_case_or_extension_are_never_paired(layout: tuple[Path, Path, Path]) -> None:
    images, controls, config = layout
    image(images / "A.jpg", 50)  # shares a's name up to case and extension
    text(images / "A.txt", "upper")
    image(controls / "b_01.png", 51)  # claims b_1's place
    found = problems(config)
    assert "differ only in case or extension" in found[str(images / "a.png")]
    assert "differ only in case or extension" in found[str(images / "A.jpg")]
    assert "b_01.png and b_1.jpg claim the same place for b.jpg" in found[str(images / "b.jpg")]


def test_unknown_keys_and_missing_settings_are_refused_naming_them(tmp_path: Path) -> None:
    config = toml(tmp_path / "d.toml", '[[datasets]]\nimage_directory = "x"\ncontol_directory = "y"\n')
    with pytest.raises(ValueError, match=r"\[\[datasets\]\] 0: unknown key\(s\) \['contol_directory'\]"):
        read_config(config)
    toml(config, f'[[datasets]]\nimage_directory = "{tmp_path}"\n')
    with pytest.raises(ValueError, match="caption_extension is not set"):
        read_config(config)
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text('{"image_path": "a.png", "caption": "x", "control_path_a": "c.png"}\n')
    toml(config, f'[[datasets]]\nimage_jsonl_file = "{jsonl}"\n')
    with pytest.raises(BadSampleError, match=r"e\.jsonl line 1: control_path_a: expected control_path_<number>"):
        read_config(config)[0].source.read(0)


def test_a_musubi_config_builds_across_ranks_and_resumes_to_the_single_process_caches(tmp_path: Path) -> None:
    images, controls = edit_directory(tmp_path)
    config = toml(
        tmp_path / "dataset.toml",
        f'[[datasets]]\nimage_directory = "{images}"\ncontrol_directory = "{controls}"\ncaption_extension = ".txt"\n'
        f"num_repeats = 2\n",
    )
    single = build(tmp_path / "one", "--musubi-config", str(config), batch_size=1)
    ranks = tmp_path / "two"
    build(
        ranks, "--musubi-config", str(config), "--rank", "1", "--world-size", "2", batch_size=1
    )  # rank 1 first: no merge
    assert not (ranks / "mixture.yaml").exists(), "rank 0 writes the mixture once the caches are merged"
    build(
        ranks,
        "--musubi-config",
        str(config),
        "--rank",
        "0",
        "--world-size",
        "2",
        "--poll-interval",
        "0.05",
        batch_size=1,
    )
    assert_same_cache(ranks / "0_images", single / "0_images")
    assert (ranks / "mixture.yaml").read_text() == (single / "mixture.yaml").read_text().replace(
        str(single), str(ranks)
    )
    build(single, "--musubi-config", str(config), batch_size=1)  # a rerun finds every sample done and changes nothing
    assert_same_cache(single / "0_images", ranks / "0_images")


def qwen_edit_docs_config(images: Path, controls: Path, cache: Path) -> str:
    """A dataset config shaped like musubi-tuner's Qwen-Image-Edit example (docs/dataset_config.md before the keys were
    renamed): [general] defaults, one control dataset, and the two Qwen-Image-Edit keys musubi still maps."""
    return (
        "[general]\n"
        "resolution = [960, 544]\n"
        'caption_extension = ".txt"\n'
        "batch_size = 1\n"
        "enable_bucket = true\n"
        "bucket_no_upscale = false\n\n"
        "[[datasets]]\n"
        f'image_directory = "{images}"\n'
        f'control_directory = "{controls}"\n'
        f'cache_directory = "{cache}"\n'
        "num_repeats = 1\n"
        "qwen_image_edit_no_resize_control = false\n"
        "qwen_image_edit_control_resolution = [1024, 1024]\n"
    )


def test_musubis_deprecated_keys_and_json_configs_build_the_cache_of_its_manifest(tmp_path: Path) -> None:
    images, controls = edit_directory(tmp_path)
    expected = [  # musubi's pairing of edit_directory (see the first test)
        ("a", "edit a.png", images / "a.png", [controls / "a.png"]),
        ("b", "edit b.jpg", images / "b.jpg", [controls / "b_0.png", controls / "b_1.jpg"]),
        ("c", "edit c.png", images / "c.png", [controls / "c.jpg", controls / "c_0001.png"]),
        ("d", "edit d.png", images / "d.png", [controls / "d.png"]),
        ("d_1", "edit d_1.png", images / "d_1.png", [controls / "d_1.png", controls / "d_1_0.png"]),
    ]
    reference = build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected)))
    qwen = toml(tmp_path / "qwen.toml", qwen_edit_docs_config(images, controls, tmp_path / "cache"))
    assert_same_cache(build(tmp_path / "qwen", "--musubi-config", str(qwen), "--dataset-index", "0"), reference)
    kontext = toml(  # FLUX.1 Kontext's old key, in a [[datasets]] table, as musubi's Kontext section showed it
        tmp_path / "kontext.toml",
        f'[[datasets]]\nimage_directory = "{images}"\ncontrol_directory = "{controls}"\ncaption_extension = ".txt"\n'
        "flux_kontext_no_resize_control = true\nno_resize_control = false\n",  # the old key beside the new: dropped
    )
    assert_same_cache(build(tmp_path / "kontext", "--musubi-config", str(kontext), "--dataset-index", "0"), reference)
    as_json = {
        "general": {"caption_extension": ".txt", "resolution": [960, 544]},
        "datasets": [
            {
                "image_directory": str(images),
                "control_directory": str(controls),
                "qwen_image_edit_control_resolution": [1024, 1024],
            }
        ],
    }
    (tmp_path / "dataset.JSON").write_text(json.dumps(as_json))  # musubi takes the suffix in any case
    config = str(tmp_path / "dataset.JSON")
    assert_same_cache(build(tmp_path / "json", "--musubi-config", config, "--dataset-index", "0"), reference)


def test_musubis_renamed_keys_are_held_to_its_schema(tmp_path: Path) -> None:
    config = toml(tmp_path / "d.toml", "[general]\nqwen_image_edit_no_resize_control = true\n\n[[datasets]]\n")
    with pytest.raises(
        ValueError,
        match=r"\[general\]: unknown key\(s\) \['no_resize_control \(written qwen_image_edit_no_resize_control\)'\]",
    ):
        read_config(config)  # musubi renames it, then its [general] schema refuses no_resize_control
    toml(config, f'[[datasets]]\nimage_directory = "{tmp_path}"\nqwen_image_edit_control_resolution = "1024"\n')
    with pytest.raises(
        ValueError, match=r"\[\[datasets\]\] 0: control_resolution: expected a size or \[width, height\]"
    ):
        read_config(config)
    (tmp_path / "d.yaml").write_text("datasets: []\n")
    with pytest.raises(ValueError, match=r"d\.yaml: musubi-tuner reads a dataset config from a \.toml or \.json file"):
        read_config(tmp_path / "d.yaml")
    (tmp_path / "d.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"d\.json: not valid JSON"):
        read_config(tmp_path / "d.json")
