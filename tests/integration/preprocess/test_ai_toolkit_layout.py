"""Claims about building caches from an ai-toolkit job config (YAML `datasets:`) as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.peers import assert_same_cache, build, image, manifest, text

from image_edit_data import ImageEditDataModule
from image_edit_data.preprocess.sources.ai_toolkit import prompt_of, read_config
from image_edit_data.preprocess.sources.base import BadSampleError


def kontext_folders(root: Path) -> tuple[Path, Path, Path]:
    """ai-toolkit's paired layout: targets with captions (one in a subfolder), two control folders by name."""
    targets, first, second = root / "targets", root / "control", root / "control2"
    for seed, name in enumerate(["a.jpg", "b.png", "sub/c.webp"]):
        image(targets / name, seed)
        image(first / (Path(name).stem + ".png"), 10 + seed)
        image(second / (Path(name).stem + ".jpg"), 20 + seed)
    text(targets / "a.txt", "make it red, add a hat\n")
    text(targets / "b.txt", "[trigger] on a beach")
    text(targets / "sub" / "c.txt", "")  # empty: default_caption
    image(targets / "_controls" / "a.png", 30)  # ai-toolkit's generated controls are not targets
    image(targets / ".hidden" / "x.png", 31)
    return targets, first, second


def job(path: Path, datasets: list[dict], trigger: str | None = "sks") -> Path:
    process = {"type": "sd_trainer", "datasets": datasets, "train": {"batch_size": 1}}
    if trigger is not None:
        process["trigger_word"] = trigger
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": "x", "process": [process]}}))
    return path


def test_an_ai_toolkit_dataset_with_control_folders_builds_the_cache_of_its_manifest(tmp_path: Path) -> None:
    targets, first, second = kontext_folders(tmp_path)
    config = job(
        tmp_path / "train.yaml",
        [
            {
                "folder_path": str(targets),
                "control_path_1": str(first),
                "control_path_2": str(second),
                "control_path": str(tmp_path / "ignored"),  # replaced by control_path_1..3, as in ai-toolkit
                "caption_ext": "txt",
                "default_caption": "a photo",
                "caption_dropout_rate": 0.05,
                "resolution": [512, 768],
            }
        ],
    )
    expected = [
        ("a", "sks make it red,  add a hat\n", targets / "a.jpg", [first / "a.png", second / "a.jpg"]),
        ("b", "sks on a beach", targets / "b.png", [first / "b.png", second / "b.jpg"]),
        ("sub/c", "sks a photo", targets / "sub" / "c.webp", [first / "c.png", second / "c.jpg"]),
    ]
    built = build(tmp_path / "out", "--ai-toolkit-config", str(config), "--dataset-index", "0")
    assert_same_cache(built, build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected))))
    assert read_config(config)[0].repeats == 2  # one copy per resolution


def test_the_prompt_is_the_caption_as_ai_toolkit_hands_it_to_the_text_encoder() -> None:
    assert prompt_of("a, b", None) == "a,  b"  # split on commas, joined with ", "
    assert prompt_of("photo of [trigger]", "sks") == "photo of sks"
    assert prompt_of("photo", "sks") == "sks photo"
    assert prompt_of("[name] dog", None) == " dog"


def test_several_ai_toolkit_datasets_build_one_cache_each_and_a_mixture_with_their_repeats(tmp_path: Path) -> None:
    targets, first, _ = kontext_folders(tmp_path)
    other = tmp_path / "other"
    image(other / "t" / "z.png", 40)
    image(other / "c" / "z.png", 41)
    text(other / "t" / "z.txt", "zoom")
    datasets = [
        {"folder_path": str(targets), "control_path": str(first), "default_caption": "x", "num_repeats": 2},
        {"folder_path": str(other / "t"), "control_path": [str(other / "c")], "resolution": [512, 768, 1024]},
    ]
    out = build(tmp_path / "out", "--ai-toolkit-config", str(job(tmp_path / "j.yaml", datasets)))
    mixture = yaml.safe_load((out / "mixture.yaml").read_text())["data"]
    assert [(s["name"], s["weight"]) for s in mixture["sources"]] == [("0_targets", 6), ("1_t", 3)]
    data = ImageEditDataModule(**mixture, batch_size=3, num_workers=0, drop_last=False, shuffle=False)
    data.setup("fit")
    drawn = [name for batch in data.train_dataloader() for name in batch["metadata"]["sources"]]
    assert (drawn.count("0_targets"), drawn.count("1_t")) == (6, 3)


def problems(config: Path, controls_per_sample: int | None = None) -> dict[str, str]:
    source = read_config(config, controls_per_sample)[0].source
    found = {}
    for position in range(len(source)):
        try:
            source.read(position)
        except BadSampleError as error:
            found[error.location] = error.problem
    return found


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    targets, first, _ = kontext_folders(tmp_path)
    config = job(tmp_path / "j.yaml", [{"folder_path": str(targets), "control_path": str(first)}])
    return targets, first, config


def test_a_target_without_its_control_or_caption_is_a_bad_sample_naming_it(layout: tuple[Path, Path, Path]) -> None:
    targets, first, config = layout
    (first / "a.png").unlink()
    image(first / "A.png", 50)  # differs only in case: ai-toolkit would not find it, nor pair it
    found = problems(config)
    assert (
        "no control image for a.jpg" in found[str(targets / "a.jpg")]
        and "A.png differs in case" in found[str(targets / "a.jpg")]
    )
    assert "matches no target" in found[str(first / "A.png")]
    assert "caption file" in found[str(targets / "sub" / "c.webp")]  # empty, and no default_caption


def test_two_controls_for_one_place_or_two_targets_sharing_a_name_are_never_paired(
    layout: tuple[Path, Path, Path],
) -> None:
    targets, first, config = layout
    image(first / "b.jpg", 60)  # b.jpg and b.png would both be b's control
    image(targets / "other" / "a.png", 61)  # shares a's name: they would share a's control
    text(targets / "other" / "a.txt", "x")
    found = problems(config)
    assert "b.jpg and b.png in" in found[str(targets / "b.png")]
    assert "share the name a" in found[str(targets / "a.jpg")] and str(targets / "other" / "a.png") in found


def test_an_unreadable_image_and_a_wrong_number_of_controls_are_bad_samples(layout: tuple[Path, Path, Path]) -> None:
    targets, first, config = layout
    (first / "b.png").write_bytes(b"nope")
    found = problems(config)
    assert "is not a readable image" in found[str(targets / "b.png")]
    assert "expected 2 control(s), got 1" in problems(config, controls_per_sample=2)[str(targets / "a.jpg")]


def test_options_that_pair_files_otherwise_are_refused_naming_them(tmp_path: Path) -> None:
    targets, _first, _ = kontext_folders(tmp_path)
    config = job(tmp_path / "j.yaml", [{"folder_path": str(targets), "control_from_same_folder": True}])
    with pytest.raises(ValueError, match=r"datasets\[0\]: control_from_same_folder picks a random control"):
        read_config(config)
    config = job(tmp_path / "j.yaml", [{"folder_path": str(targets), "control_path": str(tmp_path / "nope")}])
    with pytest.raises(FileNotFoundError, match="control_path: .*nope is not a directory"):
        read_config(config)
