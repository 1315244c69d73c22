"""musubi-tuner's dataset config (TOML or JSON) as edit sources: image directories with captions and controls, or JSONL.

Read as musubi-tuner reads it (kohya-ss/musubi-tuner `dataset/config_utils.py`, `datasources.py`):

- the file is TOML or JSON, the keys musubi renamed read under their new names (`musubi_file.py`);
- `[general]` holds defaults a `[[datasets]]` entry overrides; an unknown key is refused (musubi's schema
  refuses it too). Paths are used as written, so relative ones are relative to the working directory.
- `image_directory`: the images directly in it with musubi's extensions (`.png .jpg .jpeg .webp .bmp .avif`,
  lower or upper case), sorted by path; the caption of `name.png` is `name<caption_extension>`, stripped.
  The controls of `name.png` in `control_directory` are `name.<ext>` first, then `name_<digits>.<ext>` by
  number (`name_0`, `name_1`, or `name_0000`); targets claim controls longest name first, as musubi does.
- `image_jsonl_file`: one JSON object a line, `image_path`, `caption`, and `control_path` or `control_path_0..N`
  (ordered by number).
- `num_repeats` (default 1) is the data set's copies per epoch.

Where musubi would go on silently, this is stricter, each case a bad sample naming the files: an image
without its caption file (musubi leaves it out, so `--on-bad-sample skip` gives musubi's set), a target
without controls, a control image no target claims, two candidates for one control slot (`a.png` and
`a.jpg`, `a_1` and `a_01`), a control named like a target but not `name_<digits>`, two targets whose names
differ only in case or extension, and, with `controls_per_sample`, another number of controls (musubi keeps
the first for FLUX.1 Kontext).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import musubi_file
from .base import INVALID_ENTRY, NO_CONTEXT, NO_TARGET
from .paired import (
    AMBIGUOUS_NAME,
    CONTROL_COUNT,
    MISSING_CAPTION,
    UNPAIRED_CONTROL,
    ConfigDataset,
    PairedFileSource,
    Pairing,
    absolute,
    case_clashes,
    dataset_name,
    refused,
)

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".avif")
# musubi globs each extension in lower and in upper case, nothing in between.
GLOBBED = frozenset(EXTENSIONS) | {e.upper() for e in EXTENSIONS}
GENERAL_KEYS = frozenset({"caption_extension", "batch_size", "num_repeats", "resolution", "enable_bucket"}) | {
    "bucket_no_upscale"
}
IMAGE_KEYS = GENERAL_KEYS | {
    "image_directory",
    "image_jsonl_file",
    "cache_directory",
    "control_directory",
    "multiple_target",
    "fp_latent_window_size",
    "fp_1f_clean_indices",
    "fp_1f_target_index",
    "fp_1f_no_post",
    "no_resize_control",
    "control_resolution",
}
VIDEO_KEYS = ("video_directory", "video_jsonl_file")
MISSING_CONTEXT = "control_directory: no control image for this target"


def images_in(directory: Path) -> list[Path]:
    """The images musubi globs in `directory` (not below it), sorted by path as musubi sorts them."""
    return sorted(
        (p for p in directory.iterdir() if p.suffix in GLOBBED and not p.name.startswith(".") and p.is_file()),
        key=str,
    )


def _stem(path: Path) -> str:
    return os.path.splitext(path.name)[0]


def directory_source(
    image_directory: Path,
    caption_extension: str,
    control_directory: Path | None,
    controls_per_sample: int | None,
    provenance: Mapping[str, Any],
) -> PairedFileSource:
    """The examples of an `image_directory` data set, paired as musubi pairs them (see the module doc)."""
    for name, directory in (("image_directory", image_directory), ("control_directory", control_directory)):
        if directory is not None and not directory.is_dir():
            raise FileNotFoundError(f"{name}: {directory} is not a directory")
    targets = images_in(image_directory)
    clashes = case_clashes(targets, _stem)
    controls = _claim_controls(targets, control_directory)
    pairings: list[Pairing] = []
    for target in targets:
        where, stem = str(target), _stem(target)
        if target in clashes:
            problem = (
                f"{target.name} and {clashes[target].name} differ only in case or extension: they would share a "
                "caption file and controls (rename one)"
            )
            pairings.append(refused(where, stem, AMBIGUOUS_NAME, problem))
            continue
        caption = Path(os.path.splitext(target)[0] + caption_extension)
        if not caption.is_file():
            problem = f"caption file {caption} does not exist (musubi-tuner leaves {target.name} out of training)"
            pairings.append(refused(where, stem, MISSING_CAPTION, problem))
            continue
        if control_directory is None:
            contexts: tuple[Path, ...] = ()
        else:
            ordered = _order_controls(target, controls.get(target, []), controls_per_sample)
            if isinstance(ordered, Pairing):
                pairings.append(ordered)
                continue
            contexts = ordered
        prompt = caption.read_text(encoding="utf-8").strip()
        pairings.append(Pairing(where, stem, target, contexts, prompt))
    claimed = {c for cs in controls.values() for c in cs}
    if control_directory is not None:
        for control in images_in(control_directory):
            if control not in claimed:
                problem = (
                    f"control image {control.name} matches no target in {image_directory} (a control of "
                    f"name.png is name.<ext> or name_<n>.<ext>, same case)"
                )
                pairings.append(refused(str(control), _stem(control), UNPAIRED_CONTROL, problem))
    return PairedFileSource(pairings, provenance, MISSING_CONTEXT)


def _claim_controls(targets: list[Path], control_directory: Path | None) -> dict[Path, list[Path]]:
    """Each target's candidate controls: names starting `stem.` or `stem_`, longer target names claiming first."""
    if control_directory is None:
        return {}
    pool = set(images_in(control_directory))
    claims: dict[Path, list[Path]] = {}
    for target in sorted(targets, key=lambda p: len(p.name), reverse=True):  # stable: ties keep path order
        stem = _stem(target)
        mine = sorted(c for c in pool if c.name.startswith(stem + ".") or c.name.startswith(stem + "_"))
        pool.difference_update(mine)
        claims[target] = mine
    return claims


def _order_controls(target: Path, candidates: list[Path], expected: int | None) -> tuple[Path, ...] | Pairing:
    """The target's controls in musubi's order (no suffix, then by number), or the pairing refused with why."""
    where, stem = str(target), _stem(target)
    if not candidates:
        problem = (
            f"no control image for {target.name} in the control_directory (expected {stem}.<ext> or {stem}_0.<ext>)"
        )
        return refused(where, stem, NO_CONTEXT, problem)
    slots: dict[int, Path] = {}
    for control in candidates:
        name = _stem(control)
        suffix = name[len(stem) + 1 :]
        if name == stem:
            slot = 0
        elif name[len(stem)] == "_" and suffix.isdigit():
            slot = int(suffix) + 1
        else:
            problem = (
                f"control image {control.name} starts like {target.name} but is not {stem}.<ext> or {stem}_<n>.<ext>"
            )
            return refused(where, stem, AMBIGUOUS_NAME, problem)
        if slot in slots:
            problem = f"control images {slots[slot].name} and {control.name} claim the same place for {target.name}"
            return refused(where, stem, AMBIGUOUS_NAME, problem)
        slots[slot] = control
    ordered = tuple(slots[k] for k in sorted(slots))
    if expected is not None and len(ordered) != expected:
        names = ", ".join(p.name for p in ordered)
        problem = f"expected {expected} control image(s) for {target.name}, found {len(ordered)}: {names}"
        return refused(where, stem, CONTROL_COUNT, problem)
    return ordered


def _check_control_sizing(where: str, entry: dict[str, Any]) -> None:
    """musubi's schema for the control-image sizing keys (not read here: `--resize` sizes every image)."""
    if not isinstance(entry.get("no_resize_control", False), bool):
        raise ValueError(f"{where}: no_resize_control: expected true or false, got {entry['no_resize_control']!r}")
    size = entry.get("control_resolution", 1)
    sizes = size if isinstance(size, list) and len(size) == 2 else [size]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise ValueError(f"{where}: control_resolution: expected a size or [width, height], got {size!r}")


def jsonl_source(path: Path, controls_per_sample: int | None, provenance: Mapping[str, Any]) -> PairedFileSource:
    """The examples of an `image_jsonl_file` data set: `image_path`, `caption`, `control_path[_N]` per line."""
    if not path.is_file():
        raise FileNotFoundError(f"image_jsonl_file: {path} does not exist")
    pairings: list[Pairing] = []
    with path.open(encoding="utf-8") as stream:
        for number, text in enumerate(stream, start=1):
            if text.strip():
                pairings.append(_jsonl_pairing(f"{path} line {number}", text, controls_per_sample))
    return PairedFileSource(pairings, provenance, "control_path: no control image on this line")


def _jsonl_pairing(where: str, text: str, expected: int | None) -> Pairing:
    """One line of an image JSONL file, checked (images open later)."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        return refused(where, where, INVALID_ENTRY, f"not valid JSON ({error.msg} at column {error.colno})")
    if not isinstance(item, dict):
        return refused(where, where, INVALID_ENTRY, f"expected a JSON object, got {type(item).__name__}")
    image = item.get("image_path", item.get("image_path_0"))
    if not isinstance(image, str) or not image:
        return refused(where, where, NO_TARGET, f"image_path: expected a file path, got {image!r}")
    caption = item.get("caption")
    if not isinstance(caption, str):
        return refused(where, image, MISSING_CAPTION, f"caption: expected text, got {caption!r}")
    if "control_path" in item and "control_path_0" in item:
        return refused(where, image, AMBIGUOUS_NAME, "control_path and control_path_0 both given: one is dropped")
    numbered: dict[int, str] = {}
    for key, value in item.items():
        if key == "control_path" or key.startswith("control_path_"):
            suffix = "0" if key == "control_path" else key[len("control_path_") :]
            if not suffix.isdigit():
                return refused(where, image, INVALID_ENTRY, f"{key}: expected control_path_<number>")
            if int(suffix) in numbered:
                return refused(where, image, AMBIGUOUS_NAME, f"{key}: another key has the number {int(suffix)}")
            if not isinstance(value, str) or not value:
                return refused(where, image, INVALID_ENTRY, f"{key}: expected a file path, got {value!r}")
            numbered[int(suffix)] = value
    controls = tuple(absolute(numbered[k]) for k in sorted(numbered))
    if expected is not None and controls and len(controls) != expected:
        problem = f"expected {expected} control path(s), got {len(controls)}: {sorted(numbered.values())}"
        return refused(where, image, CONTROL_COUNT, problem)
    return Pairing(where, image, absolute(image), controls, caption)


def read_config(path: str | Path, controls_per_sample: int | None = None) -> list[ConfigDataset]:
    """Every `[[datasets]]` entry of a musubi-tuner dataset config (TOML or JSON), in order, as an edit source."""
    config_path = Path(path)
    config, renamed = musubi_file.load(config_path)
    general = config.get("general", {})
    unknown = [f"{k} (written {renamed[k]})" if k in renamed else k for k in sorted(set(general) - GENERAL_KEYS)]
    if unknown:
        raise ValueError(
            f"{config_path}: [general]: unknown key(s) {unknown}; musubi-tuner accepts {sorted(GENERAL_KEYS)}"
        )
    entries = config.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{config_path}: expected one or more [[datasets]] tables, got {entries!r}")
    return [_dataset(config_path, i, dict(general), entry, controls_per_sample) for i, entry in enumerate(entries)]


def _dataset(
    config_path: Path, index: int, general: dict[str, Any], entry: dict[str, Any], controls_per_sample: int | None
) -> ConfigDataset:
    where = f"{config_path}: [[datasets]] {index}"
    if any(key in entry for key in VIDEO_KEYS):
        raise ValueError(
            f"{where}: a video data set ({', '.join(k for k in VIDEO_KEYS if k in entry)}), not image edits"
        )
    unknown = sorted(set(entry) - IMAGE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; musubi-tuner accepts {sorted(IMAGE_KEYS)}")
    if entry.get("multiple_target"):
        raise ValueError(f"{where}: multiple_target (Qwen-Image-Layered targets) is not an edit layout")
    _check_control_sizing(where, entry)
    settings = general | entry
    repeats = settings.get("num_repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{where}: num_repeats: expected a positive integer, got {repeats!r}")
    given = [k for k in ("image_directory", "image_jsonl_file") if k in entry]
    if len(given) != 1:
        raise ValueError(f"{where}: expected exactly one of image_directory or image_jsonl_file, got {given or 'none'}")
    provenance = {"kind": "musubi-tuner", "config": str(config_path.resolve()), "dataset": index}
    if controls_per_sample is not None:
        provenance["controls_per_sample"] = controls_per_sample
    if "image_jsonl_file" in entry:
        jsonl = absolute(entry["image_jsonl_file"])
        source = jsonl_source(jsonl, controls_per_sample, provenance | {"path": str(jsonl)})
        name = dataset_name(index, jsonl)
    else:
        caption_extension = settings.get("caption_extension")
        if not isinstance(caption_extension, str) or not caption_extension:
            raise ValueError(
                f"{where}: caption_extension is not set (here or in [general]); musubi-tuner reads the caption of "
                'name.png from name<caption_extension>, e.g. caption_extension = ".txt"'
            )
        images = absolute(entry["image_directory"])
        control = absolute(entry["control_directory"]) if "control_directory" in entry else None
        source = directory_source(
            images, caption_extension, control, controls_per_sample, provenance | {"path": str(images)}
        )
        name = dataset_name(index, images)
    return ConfigDataset(name, source, repeats, f"num_repeats {repeats}")
