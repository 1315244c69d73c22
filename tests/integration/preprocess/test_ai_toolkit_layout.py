"""Claims about building caches from an ai-toolkit job config (YAML `datasets:`) as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image
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


KONTEXT_EXAMPLE = """\
# Shaped like ai-toolkit's config/examples/train_lora_flux_kontext_24gb.yaml, with flip_x, an environment
# variable and [name] in the paths.
job: extension
config:
  name: "my_first_flux_kontext_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      device: cuda:0
      trigger_word: "p3r5on"
      network: {type: "lora", linear: 16, linear_alpha: 16}
      datasets:
        - folder_path: "${AITK_DATA}/[name]/images"
          control_path: "${AITK_DATA}/[name]/control"
          caption_ext: "txt"
          caption_dropout_rate: 0.05
          shuffle_tokens: false
          cache_latents_to_disk: true
          flip_x: true
          resolution: [ 512, 768 ]
      train: {batch_size: 1, steps: 3000, lr: 1e-4, dtype: bf16}
      model:
        name_or_path: "black-forest-labs/FLUX.1-Kontext-dev"
        arch: "flux_kontext"
        quantize: true
meta:
  name: "[name]"
  version: '1.0'
"""


def mirror_copies(root: Path, items: list[tuple[str, str, Path, list[Path]]], axes: str, controls: bool) -> list:
    """Manifest rows for the copies ai-toolkit adds, with images this test mirrors itself (PIL, not the route)."""
    rows = []
    for sample_id, prompt, target, contexts in items:

        def mirrored(path: Path) -> Path:
            picture = Image.open(path).convert("RGB")
            for axis in axes:
                picture = picture.transpose(Image.FLIP_LEFT_RIGHT if axis == "x" else Image.FLIP_TOP_BOTTOM)
            out = root / f"{path.parent.name}_{path.stem}_{axes}.png"
            picture.save(out)
            return out

        flipped = [mirrored(c) for c in contexts] if controls else contexts
        suffix = "".join(f"#flip_{axis}" for axis in axes)
        rows.append((sample_id + suffix, prompt, mirrored(target), flipped, {f"flip_{axis}": True for axis in axes}))
    return rows


def test_ai_toolkits_kontext_example_with_flip_x_builds_each_item_and_its_mirror_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data" / "my_first_flux_kontext_lora_v1"  # ${AITK_DATA}/[name]
    targets, control, _ = kontext_folders(root)
    targets = targets.rename(root / "images")  # the example's folder name
    monkeypatch.setenv("AITK_DATA", str(tmp_path / "data"))
    config = tmp_path / "train_lora_flux_kontext_24gb.yaml"
    config.write_text(KONTEXT_EXAMPLE)
    originals = [
        ("a", "p3r5on make it red,  add a hat\n", targets / "a.jpg", [control / "a.png"]),
        ("b", "p3r5on on a beach", targets / "b.png", [control / "b.png"]),
    ]
    (targets / "sub" / "c.txt").write_text("a sketch")
    originals.append(("sub/c", "p3r5on a sketch", targets / "sub" / "c.webp", [control / "c.png"]))
    (tmp_path / "mirrored").mkdir()
    copies = mirror_copies(tmp_path / "mirrored", originals, "x", controls=True)  # Kontext mirrors its controls too
    rows = [(*o, {}) for o in originals] + copies
    reference = manifest(tmp_path / "m.jsonl", [r[:4] for r in rows], [r[4] for r in rows])
    out = build(tmp_path / "out", "--ai-toolkit-config", str(config))
    assert_same_cache(out / "0_images", build(tmp_path / "ref", "--manifest", str(reference)), media=False)
    # ai-toolkit's items per epoch, counted from its loader: 3 images x num_repeats 1 x 2 (flip_x) x 2 resolutions.
    items_per_epoch = 3 * 1 * 2 * 2
    mixture = yaml.safe_load((out / "mixture.yaml").read_text())["data"]
    assert mixture["samples_per_epoch"] == items_per_epoch
    data = ImageEditDataModule(**mixture, batch_size=4, num_workers=0, drop_last=False, shuffle=False)
    data.setup("fit")
    assert sum(len(batch["metadata"]["sources"]) for batch in data.train_dataloader()) == items_per_epoch


QWEN_EDIT_EXAMPLE = """\
# Shaped like ai-toolkit's config/examples/train_lora_qwen_image_edit_2509_32gb.yaml: a list of control folders,
# here with flip_x and flip_y and two repeats.
job: extension
config:
  name: "my_first_qwen_image_edit_2509_lora_v1"
  process:
    - type: 'diffusion_trainer'
      datasets:
        - folder_path: "{targets}"
          control_path:
            - "{first}"
            - "{second}"
          caption_ext: "txt"
          default_caption: "a person"
          caption_dropout_rate: 0.05
          resolution: [ 512, 768, 1024 ]
          num_repeats: 2
          flip_x: true
          flip_y: true
      model:
        name_or_path: "Qwen/Qwen-Image-Edit-2509"
        arch: "qwen_image_edit_plus"
"""


def test_qwen_edit_plus_flips_leave_its_raw_control_images_unmirrored(tmp_path: Path) -> None:
    targets, first, second = kontext_folders(tmp_path)
    config = tmp_path / "qwen.yaml"
    config.write_text(QWEN_EDIT_EXAMPLE.format(targets=targets, first=first, second=second))
    originals = [
        ("a", "make it red,  add a hat\n", targets / "a.jpg", [first / "a.png", second / "a.jpg"]),
        ("b", " on a beach", targets / "b.png", [first / "b.png", second / "b.jpg"]),
        ("sub/c", "a person", targets / "sub" / "c.webp", [first / "c.png", second / "c.jpg"]),
    ]
    (tmp_path / "mirrored").mkdir()
    rows = [(*o, {}) for o in originals]
    for axes in ("x", "y", "xy"):  # ai-toolkit's blocks: originals, x copies, y copies of both
        rows += mirror_copies(tmp_path / "mirrored", originals, axes, controls=False)
    reference = manifest(tmp_path / "m.jsonl", [r[:4] for r in rows], [r[4] for r in rows])
    out = build(tmp_path / "out", "--ai-toolkit-config", str(config), "--dataset-index", "0")
    assert_same_cache(out, build(tmp_path / "ref", "--manifest", str(reference)), media=False)
    dataset = read_config(config)[0]
    # ai-toolkit's items per epoch: 3 images x num_repeats 2 x 4 (flip_x, flip_y) x 3 resolutions.
    assert len(dataset.source) * dataset.repeats == 3 * 2 * 4 * 3


def test_the_legacy_caption_type_is_used_as_written_without_a_dot(tmp_path: Path) -> None:
    targets, first, _ = kontext_folders(tmp_path)
    text(
        targets / "bcap", "from bcap"
    )  # b.png's caption when caption_type is "cap": "b" + "cap", as ai-toolkit joins it
    datasets = [
        {"folder_path": str(targets), "control_path": str(first), "caption_type": "cap", "default_caption": "d"}
    ]
    source = read_config(job(tmp_path / "j.yaml", datasets, trigger=None))[0].source
    assert [source.read(i).sample.prompt for i in range(3)] == ["d", "from bcap", "d"]
    datasets[0]["caption_type"] = ".txt"
    source = read_config(job(tmp_path / "j.yaml", datasets, trigger=None))[0].source
    assert source.read(0).sample.prompt == "make it red,  add a hat\n"
    del datasets[0]["default_caption"]
    datasets[0]["caption_type"] = "txt"
    with pytest.raises(BadSampleError, match=r"atxt does not exist .*\(caption_type 'txt' is used as written"):
        read_config(job(tmp_path / "j.yaml", datasets, trigger=None))[0].source.read(0)


def test_ai_toolkit_config_files_are_refused_where_ai_toolkit_refuses_them(tmp_path: Path) -> None:
    targets, first, _ = kontext_folders(tmp_path)
    config = tmp_path / "j.yaml"
    config.write_text(
        "job: extension\nconfig:\n  name: x\n  process:\n    - datasets:\n        - folder_path: ${NOPE_UNSET}\n"
    )
    with pytest.raises(ValueError, match=r"j\.yaml: \$\{NOPE_UNSET\}: environment variable NOPE_UNSET is not set"):
        read_config(config)
    config.write_text("job: extension\nconfig:\n  process: []\n")
    with pytest.raises(ValueError, match=r"config\.name: ai-toolkit needs a name"):
        read_config(config)
    (tmp_path / "j.toml").write_text("")
    with pytest.raises(
        ValueError, match=r"j\.toml: ai-toolkit reads a job config from a \.yaml, \.yml, \.json or \.jsonc"
    ):
        read_config(tmp_path / "j.toml")
    as_json = {
        "job": "extension",
        "config": {
            "name": "n",
            "process": [
                {
                    "datasets": [
                        {"folder_path": str(targets).replace(str(tmp_path), "[name]"), "control_path": str(first)}
                    ]
                }
            ],
        },
    }
    (tmp_path / "n").symlink_to(tmp_path)  # [name] -> n, a link back to tmp_path
    (tmp_path / "j.json").write_text(json.dumps(as_json).replace('"[name]', f'"{tmp_path}/[name]'))
    assert read_config(tmp_path / "j.json")[0].source.folder == tmp_path / "n" / "targets"
