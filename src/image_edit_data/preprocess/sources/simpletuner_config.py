"""SimpleTuner's `multidatabackend.json` resolved into image data sets, the references they name and their rules.

SimpleTuner loads the file with `json.load` (a byte-order mark is an error there too), skips disabled data sets,
fills `{env:VAR}` (empty when unset) and `{id}` into every string, and connects each image data set's
`conditioning_data` to data sets of `dataset_type` conditioning, failing on an id it cannot find. Cache data sets
(text or image embeds) and validation sets (`eval`) hold no training pairs and are passed over.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import EMPTY_PROMPT, BadSampleError
from .paired import MISSING_CAPTION, absolute

STRATEGIES = ("filename", "textfile", "instanceprompt")
SEVERAL_CAPTIONS = "several captions"
PASSED_OVER = frozenset({"text_embeds", "image_embeds", "conditioning_image_embeds", "distillation_cache", "eval"})
NOT_EDITS = frozenset({"video", "audio", "caption", "grounding"})
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
# Keys that make the data set another one from step to step or epoch to epoch, or are read from elsewhere.
REFUSED = {
    "conditioning": "generates its conditioning images at training time",
    "is_regularisation_data": "is regularisation data SimpleTuner trains against the base model",
    "is_regularization_data": "is regularisation data SimpleTuner trains against the base model",
    "max_num_samples": "draws a subset SimpleTuner seeds by its own generator",
    "caption_filter_list": "filters captions by a list this route does not apply",
    "end_epoch": "stops the data set at an epoch (a schedule a mixture cannot hold)",
    "end_step": "stops the data set at a step (a schedule a mixture cannot hold)",
    "minimum_aspect_ratio": "filters by SimpleTuner's aspect buckets, which this route does not compute",
    "maximum_aspect_ratio": "filters by SimpleTuner's aspect buckets, which this route does not compute",
}


@dataclass(frozen=True)
class Captions:
    """How one image data set's prompts are made (see the module doc)."""

    strategy: str
    instance_prompt: str | None
    prepend: bool
    only_instance_prompt: bool
    multiline: bool

    def prompt(self, image: Path) -> str:
        """The prompt of `image`; raises `BadSampleError` where SimpleTuner would not have exactly one."""
        where = str(image)
        instance = self.instance_prompt or ""
        if self.strategy == "instanceprompt":
            return instance.strip()
        if self.only_instance_prompt:
            return instance
        if self.strategy == "filename":
            caption = image.stem.replace("_", " ")
        else:
            caption_file = Path(os.path.splitext(image)[0] + ".txt")
            if not caption_file.is_file():
                problem = f"caption file {caption_file} does not exist (caption_strategy textfile)"
                raise BadSampleError(where, MISSING_CAPTION, problem)
            caption = caption_file.read_bytes().decode("utf-8")
            if self.multiline and "\n" in caption:
                lines = [line for line in caption.split("\n") if line]
                if len(lines) != 1:
                    problem = (
                        f"caption file {caption_file} holds {len(lines)} captions, one a line: SimpleTuner picks one "
                        "at random each time it shows the image (set disable_multiline_split or keep one line)"
                    )
                    raise BadSampleError(where, EMPTY_PROMPT if not lines else SEVERAL_CAPTIONS, problem)
                caption = lines[0]
        return f"{instance} {caption}" if self.prepend else caption


@dataclass(frozen=True)
class SizeFilter:
    """SimpleTuner's `minimum_image_size` test of a target's pixel size."""

    minimum: float | None
    resolution_type: str
    square_crop: bool

    def too_small(self, width: int, height: int) -> bool:
        if not self.minimum:
            return False
        if self.resolution_type == "pixel":
            return not (self.minimum <= width and self.minimum <= height)
        # pixel_area gives a side length (squared, as SimpleTuner converts it), or megapixels up to 10
        if self.resolution_type == "pixel_area" and self.minimum > 10:
            area = self.minimum * self.minimum
        else:
            area = self.minimum * 1_000_000
        if self.square_crop:
            edge = math.floor(math.sqrt(area))
            if not (edge <= width and edge <= height):
                return True
        return area > width * height


@dataclass(frozen=True)
class ImageSet:
    """An enabled image data set and what its samples are made of."""

    id: str
    safe_id: str  # the id as a directory name
    folder: Path
    conditioning: tuple[str, ...]  # ids of its reference data sets, in order
    captions: Captions
    sizes: SizeFilter
    repeats: int


def load(path: Path, conditioning_sampling: str | None) -> tuple[list[ImageSet], dict[str, Path]]:
    """The enabled image data sets in file order, and each conditioning data set's folder by id."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: SimpleTuner data backend config does not exist")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a JSON list of data sets, as multidatabackend.json holds")
    images, references, seen = [], {}, set()
    for number, raw in enumerate(entries):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            raise ValueError(f"{path}: data set {number}: expected an object with an id, got {raw!r}")
        if raw.get("disabled") or raw.get("disable"):
            continue
        entry = _resolved(raw, raw["id"])
        where = f"{path}: data set {entry['id']!r}"
        if entry["id"] in seen:
            raise ValueError(f"{where}: the id is used twice")
        seen.add(entry["id"])
        kind = str(entry.get("dataset_type") or "image").strip().lower()
        if kind in PASSED_OVER:
            continue
        if kind in NOT_EDITS:
            raise ValueError(f"{where}: a {kind} data set, not image edits")
        if kind == "conditioning":
            if entry.get("conditioning_type") not in (None, "", "reference_strict", "reference_loose"):
                problem = f"conditioning_type {entry['conditioning_type']!r} is not a reference image set"
                raise ValueError(f"{where}: {problem} (reference_strict or reference_loose)")
            references[entry["id"]] = _folder(where, entry)
        elif kind == "image":
            images.append((where, entry))
        else:
            raise ValueError(f"{where}: dataset_type: unknown value {kind!r}")
    built = [_image_set(where, entry, references, conditioning_sampling) for where, entry in images]
    if not built:
        raise ValueError(f"{path}: no enabled image data set (dataset_type image) to build")
    return built, references


def _resolved(value: Any, dataset_id: str) -> Any:
    """`value` with `{env:VAR}` and `{id}` filled into its strings, as SimpleTuner fills them."""
    if isinstance(value, str):

        def fill(match: re.Match[str]) -> str:
            token = match.group(1)
            if token.startswith("env:"):
                return os.environ.get(token[4:], "")
            return dataset_id if token == "id" else match.group(0)

        return PLACEHOLDER.sub(fill, value)
    if isinstance(value, list):
        return [_resolved(v, dataset_id) for v in value]
    if isinstance(value, dict):
        return {k: _resolved(v, dataset_id) for k, v in value.items()}
    return value


def _folder(where: str, entry: dict[str, Any]) -> Path:
    backend = entry.get("type", "local")
    if backend != "local":
        raise ValueError(f"{where}: type {backend!r}: only local data sets are read (nothing is downloaded)")
    value = entry.get("instance_data_dir", entry.get("instance_data_root"))
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: instance_data_dir: expected a folder, got {value!r}")
    unknown = PLACEHOLDER.search(value)
    if unknown:
        raise ValueError(
            f"{where}: instance_data_dir: {unknown.group(0)} is filled from SimpleTuner's config.json, which this "
            "route does not read; write the folder out"
        )
    folder = absolute(value.strip())
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}: instance_data_dir: {folder} is not a directory")
    return folder


def _image_set(
    where: str, entry: dict[str, Any], references: dict[str, Path], conditioning_sampling: str | None
) -> ImageSet:
    for key, why in REFUSED.items():
        if entry.get(key):
            raise ValueError(f"{where}: {key} {why}; remove it or build that data set otherwise")
    if int(entry.get("start_epoch") or 1) > 1 or int(entry.get("start_step") or 0) > 0:
        raise ValueError(
            f"{where}: start_epoch / start_step start the data set late (a schedule a mixture cannot hold)"
        )
    if (entry.get("caption_shuffle") or {}).get("enable"):
        raise ValueError(f"{where}: caption_shuffle draws a shuffled caption at each step; a cache holds one")
    if "probability" in entry and entry["probability"] not in (None, "") and float(entry["probability"]) <= 0:
        raise ValueError(
            f"{where}: probability {entry['probability']}: SimpleTuner never draws it (set disabled: true)"
        )
    linked = entry.get("conditioning_data") or []
    linked = [linked] if isinstance(linked, str) else list(linked)
    missing = [ref for ref in linked if ref not in references]
    if missing:
        raise ValueError(
            f"{where}: conditioning_data: {missing} is no enabled data set of dataset_type conditioning "
            f"(those are {sorted(references)})"
        )
    if len(linked) > 1 and conditioning_sampling != "combined":
        raise ValueError(
            f"{where}: conditioning_data names {len(linked)} data sets; SimpleTuner's "
            f"conditioning_multidataset_sampling {conditioning_sampling or 'random (its default)'} picks one per "
            "sample per epoch, which a cache cannot hold: give --conditioning-multidataset-sampling combined to use "
            "them all, in order"
        )
    repeats = entry.get("repeats") or 0
    try:
        repeats = int(repeats)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: repeats: expected a whole number of extra passes, got {repeats!r}") from None
    if repeats < 0:
        raise ValueError(f"{where}: repeats: expected 0 or more extra passes, got {repeats}")
    return ImageSet(
        entry["id"],
        re.sub(r"[^A-Za-z0-9._-]+", "-", entry["id"]).strip("-.") or "data",
        _folder(where, entry),
        tuple(linked),
        _captions(where, entry),
        _sizes(where, entry),
        repeats,
    )


def _captions(where: str, entry: dict[str, Any]) -> Captions:
    strategy = entry.get("caption_strategy") or "filename"
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: caption_strategy {strategy!r}: this route reads {list(STRATEGIES)}")
    instance = entry.get("instance_prompt")
    if isinstance(instance, list):
        if len(instance) != 1:
            raise ValueError(f"{where}: instance_prompt: a list is a random choice per step; give one prompt")
        instance = instance[0]
    only = bool(entry.get("only_instance_prompt"))
    prepend = bool(entry.get("prepend_instance_prompt"))
    needs = strategy == "instanceprompt" or only or prepend
    if needs and (not isinstance(instance, str) or not instance.strip()):
        raise ValueError(f"{where}: instance_prompt: expected text (caption_strategy {strategy}), got {instance!r}")
    return Captions(strategy, instance, prepend, only, not entry.get("disable_multiline_split"))


def _sizes(where: str, entry: dict[str, Any]) -> SizeFilter:
    kind = entry.get("resolution_type") or "pixel_area"
    if kind not in ("pixel", "area", "pixel_area"):
        raise ValueError(f"{where}: resolution_type: expected pixel, area or pixel_area, got {kind!r}")
    minimum = entry.get("minimum_image_size")
    minimum = float(minimum) if minimum not in (None, "") else None
    if kind == "area" and minimum is not None and minimum > 5:
        raise ValueError(f"{where}: minimum_image_size {minimum} with resolution_type area is in megapixels (under 5)")
    square = bool(entry.get("crop")) and (entry.get("crop_aspect") or "square") == "square"
    return SizeFilter(minimum, kind, square)
