"""Claims about building caches from SimpleTuner's multidatabackend.json (edit data sets and their references) as it is.

The fixtures follow SimpleTuner's own examples: the Qwen-Image-Edit quickstart's edit-v1 (one reference data set
and a conditioning-image-embed cache) and edit-v2 (several reference data sets) snippets, and the FLUX Kontext
quickstart's validation example (pixel_area resolution, minimum_image_size, filename captions).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.peers import assert_same_cache, build, image, manifest, text

from image_edit_data import ImageEditDataModule
from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.preprocess.sources.simpletuner import read_config


def edit_pairs(root: Path, names: tuple[str, ...] = ("a.png", "b.jpg", "sub/c.png"), refs: int = 1) -> tuple[Path, ...]:
    """An edited-images folder with .txt captions and `refs` reference folders holding the same file names."""
    edited = root / "edited-images"
    folders = [root / f"reference-images-{k}" for k in range(refs)]
    for seed, name in enumerate(names):
        image(edited / name, seed)
        for k, folder in enumerate(folders):
            image(folder / name, 10 * (k + 1) + seed)
    text(edited / "a.txt", "make it red\n")  # one line and its newline: one caption
    text(edited / "b.txt", "add a cat")
    text(edited / "sub" / "c.txt", "remove the tree")
    return (edited, *folders)


def write(path: Path, backends: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(backends, indent=2))
    return path


def qwen_edit_v1(edited: Path, references: Path) -> list[dict[str, Any]]:
    """The Qwen-Image-Edit quickstart's edit-v1 data sets, with a text-embed cache as its examples add one."""
    return [
        {
            "id": "my-edited-images",
            "type": "local",
            "instance_data_dir": str(edited),
            "caption_strategy": "textfile",
            "resolution": 1024,
            "conditioning_data": ["my-reference-images"],
            "conditioning_image_embeds": "my-reference-embeds",
            "cache_dir_vae": "cache/vae/edited-images",
        },
        {
            "id": "my-reference-images",
            "type": "local",
            "dataset_type": "conditioning",
            "instance_data_dir": str(references),
            "conditioning_type": "reference_strict",
            "resolution": 1024,
            "cache_dir_vae": "cache/vae/reference-images",
        },
        {
            "id": "my-reference-embeds",
            "type": "local",
            "dataset_type": "conditioning_image_embeds",
            "cache_dir": "cache/conditioning_image_embeds/reference",
        },
        {
            "id": "text-embed-cache",
            "dataset_type": "text_embeds",
            "default": True,
            "cache_dir": "cache/text/{model_family}",
        },
    ]


def test_a_qwen_edit_v1_multidatabackend_builds_the_cache_of_its_manifest(tmp_path: Path) -> None:
    edited, references = edit_pairs(tmp_path)
    config = write(tmp_path / "multidatabackend.json", qwen_edit_v1(edited, references))
    expected = [  # SimpleTuner's pairing: the same relative path below the reference folder
        ("a.png", "make it red", edited / "a.png", [references / "a.png"]),
        ("b.jpg", "add a cat", edited / "b.jpg", [references / "b.jpg"]),
        ("sub/c.png", "remove the tree", edited / "sub" / "c.png", [references / "sub" / "c.png"]),
    ]
    built = build(tmp_path / "out", "--simpletuner-config", str(config), "--dataset-index", "0")
    assert_same_cache(built, build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected))))


def test_several_image_data_sets_build_one_cache_each_and_a_mixture_weighted_as_simpletuners_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edited, first, second = edit_pairs(tmp_path / "edit", refs=2)
    kontext = tmp_path / "kontext"  # filename captions, a small image under minimum_image_size
    for seed, (name, size) in enumerate(
        [("a_red_hat.png", (32, 32)), ("big_boat.png", (32, 24)), ("tiny.png", (16, 16))]
    ):
        image(kontext / "edit" / name, 40 + seed, size)
        image(kontext / "ref" / name, 50 + seed, size)
    monkeypatch.setenv("ST_DATA", str(kontext))
    backends = [
        {  # the Qwen-Image-Edit quickstart's edit-v2: three reference sets there, two here
            "id": "my-edited-images",
            "type": "local",
            "instance_data_dir": str(edited),
            "caption_strategy": "textfile",
            "resolution": 1024,
            "conditioning_data": ["my-reference-images-a", "my-reference-images-b"],
            "cache_dir_vae": "cache/vae/edited-images",
        },
        *(
            {
                "id": f"my-reference-images-{k}",
                "type": "local",
                "dataset_type": "conditioning",
                "instance_data_dir": str(folder),
                "conditioning_type": "reference_strict",
                "resolution": 1024,
            }
            for k, folder in (("a", first), ("b", second))
        ),
        {  # the FLUX Kontext quickstart's validation example's settings
            "id": "edited-images",
            "disabled": False,
            "type": "local",
            "instance_data_dir": "{env:ST_DATA}/edit",
            "minimum_image_size": 20,  # pixel_area: a 20-pixel side squared, 400 pixels: tiny.png (256) is left out
            "resolution": 1024,
            "resolution_type": "pixel_area",
            "caption_strategy": "filename",
            "cache_dir_vae": "cache/vae/{id}",
            "conditioning_data": ["reference-images"],
            "repeats": 2,
            "probability": 0.5,
        },
        {
            "id": "reference-images",
            "type": "local",
            "instance_data_dir": "{env:ST_DATA}/ref",
            "caption_strategy": None,
            "dataset_type": "conditioning",
            "conditioning_type": "reference_strict",
        },
        {"id": "old-set", "disabled": True, "instance_data_dir": "/nowhere"},
    ]
    config = write(tmp_path / "multidatabackend.json", backends)
    out = build(
        tmp_path / "out",
        "--simpletuner-config",
        str(config),
        "--conditioning-multidataset-sampling",
        "combined",
        "--on-bad-sample",
        "skip",
    )
    expected = [
        ("a_red_hat.png", "a red hat", kontext / "edit" / "a_red_hat.png", [kontext / "ref" / "a_red_hat.png"]),
        ("big_boat.png", "big boat", kontext / "edit" / "big_boat.png", [kontext / "ref" / "big_boat.png"]),
    ]
    reference = build(tmp_path / "ref", "--manifest", str(manifest(tmp_path / "m.jsonl", expected)))
    assert_same_cache(out / "1_edited-images", reference)
    combined = [("a.png", "make it red", edited / "a.png", [first / "a.png", second / "a.png"])]
    one = build(tmp_path / "ref2", "--manifest", str(manifest(tmp_path / "m2.jsonl", combined)), "--num-samples", "1")
    assert_same_cache(
        build(
            tmp_path / "qwen",
            "--simpletuner-config",
            str(config),
            "--dataset-index",
            "0",
            "--num-samples",
            "1",
            "--conditioning-multidataset-sampling",
            "combined",
        ),
        one,
    )
    # SimpleTuner's epoch drains every data set 1 + repeats times, whatever its probability: 3 x 1 and 2 x 3.
    per_epoch = {"0_my-edited-images": 3 * (1 + 0), "1_edited-images": 2 * (1 + 2)}
    mixture = yaml.safe_load((out / "mixture.yaml").read_text())["data"]
    assert mixture["samples_per_epoch"] == sum(per_epoch.values())
    data = ImageEditDataModule(**mixture, batch_size=3, num_workers=0, drop_last=False, shuffle=False)
    data.setup("fit")
    drawn = [name for batch in data.train_dataloader() for name in batch["metadata"]["sources"]]
    assert {name: drawn.count(name) for name in per_epoch} == per_epoch


def problems(config: Path, sampling: str | None = None) -> dict[str, str]:
    source = read_config(config, conditioning_sampling=sampling)[0].source
    found = {}
    for position in range(len(source)):
        try:
            source.read(position)
        except BadSampleError as error:
            found[error.location] = error.problem
    return found


def test_unpaired_files_and_several_captions_are_bad_samples_naming_them(tmp_path: Path) -> None:
    edited, references = edit_pairs(tmp_path)
    config = write(tmp_path / "m.json", qwen_edit_v1(edited, references))
    (references / "b.jpg").rename(references / "b.png")  # another extension: SimpleTuner pairs the exact name
    text(edited / "sub" / "c.txt", "remove the tree\nremove the bush\n")
    found = problems(config)
    assert "no reference image b.jpg in 'my-reference-images'" in found[str(edited / "b.jpg")]
    assert "b.png differs in extension" in found[str(edited / "b.jpg")]
    assert "matches no target" in found[str(references / "b.png")]
    assert "holds 2 captions, one a line: SimpleTuner picks one" in found[str(edited / "sub" / "c.png")]
    backends = qwen_edit_v1(edited, references)
    backends[0]["disable_multiline_split"] = True
    source = read_config(write(tmp_path / "m.json", backends))[0].source
    assert source.read(2).sample.prompt == "remove the tree\nremove the bush\n"


BAD_CONFIGS = [
    (lambda b: b[1].pop("dataset_type"), r"conditioning_data: \['my-reference-images'\] is no enabled data set of"),
    (lambda b: b[0].update(type="aws"), r"'my-edited-images': type 'aws': only local data sets are read"),
    (lambda b: b[0].update(probability=0), r"probability 0: SimpleTuner never draws it"),
    (lambda b: b[0].update(caption_strategy="parquet"), r"caption_strategy 'parquet': this route reads"),
    (lambda b: b[0].update(max_num_samples=2), r"max_num_samples draws a subset"),
    (lambda b: b[0].update(instance_data_dir="{output_dir}/x"), r"\{output_dir\} is filled from SimpleTuner's config"),
    (lambda b: b[1].update(conditioning_type="controlnet"), r"conditioning_type 'controlnet' is not a reference"),
]


@pytest.mark.parametrize(("change", "message"), BAD_CONFIGS)
def test_configs_simpletuner_would_read_otherwise_are_refused_naming_the_key(
    tmp_path: Path, change: Any, message: str
) -> None:
    edited, references = edit_pairs(tmp_path)
    backends = qwen_edit_v1(edited, references)
    change(backends)
    with pytest.raises(ValueError, match=message):
        read_config(write(tmp_path / "m.json", backends))


def test_several_references_need_combined_sampling(tmp_path: Path) -> None:
    edited, first, second = edit_pairs(tmp_path, refs=2)
    backends = qwen_edit_v1(edited, first)
    backends[0]["conditioning_data"] = ["my-reference-images", "second"]
    backends.append({**backends[1], "id": "second", "instance_data_dir": str(second)})
    config = write(tmp_path / "m.json", backends)
    with pytest.raises(ValueError, match=r"conditioning_multidataset_sampling random \(its default\) picks one"):
        read_config(config)
    build(tmp_path / "out", "--simpletuner-config", str(config), expect=1)
    assert [
        len(r.sample.contexts)
        for r in map(read_config(config, conditioning_sampling="combined")[0].source.read, range(3))
    ] == [2, 2, 2]
