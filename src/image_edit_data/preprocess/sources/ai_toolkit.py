"""ai-toolkit's job config (YAML or JSON) as edit sources: each `datasets:` entry's folder of targets with its controls.

Read as ai-toolkit reads it (ostris/ai-toolkit `toolkit/config_modules.py` DatasetConfig, `toolkit/data_loader.py`,
`toolkit/dataloader_mixins.py`):

- the file is loaded as ai-toolkit loads it, `${VAR}` and `[name]` substituted (`ai_toolkit_file.py`);
- the data sets are `config.process[*].datasets`; a process's `trigger_word` goes to those that set none;
- targets are the `.jpg .jpeg .png .webp` files (any case) under `folder_path`, subfolders included, except
  hidden files and folders and `_controls` folders; they are ordered by path here (ai-toolkit shuffles);
- the caption of `sub/name.png` is `sub/name<caption_ext>` (default `.txt`, a missing dot added; the legacy
  `caption_type`, when set, replaces it as written, without a dot added), or
  `default_caption` when the file is missing or empty; as ai-toolkit builds the prompt it sees, the text's
  commas are rejoined with `", "`, `[trigger]` and `[name]` become the trigger word, and a trigger word the
  caption lacks is put in front (`"<trigger> <caption>"`);
- `control_path` (one folder or a list), replaced by `control_path_1..3` when any is set: in each folder the
  control of `name.png` is the first of `name.jpg`, `name.jpeg`, `name.png`, `name.webp`, in folder order;
- `flip_x` / `flip_y` add mirrored copies of every example, which are samples of the cache (`flips.py`);
- a data set appears `num_repeats` times per epoch, and once per entry of a `resolution` list.

Stricter than ai-toolkit, each a bad sample naming the files: a target without a control in one of the
folders (ai-toolkit trains with fewer or none), a missing caption without `default_caption` (ai-toolkit
trains on an empty prompt), two controls for one place (`name.jpg` and `name.png`), a control differing
from its target's name only in case, two targets sharing a name in different subfolders or extensions
(they would share controls), and a control image no target claims. Options that pair files otherwise
(`control_from_same_folder`, `mask_path`, `inpaint_path`, `is_reg`, a JSON `dataset_path`, ...) are refused;
training-time randomness (caption dropout, shuffled tokens) has no place in a cache and is not applied.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import ai_toolkit_file
from .base import NO_CONTEXT
from .flips import Flips
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

EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")  # ai-toolkit's order: the first found is the control
# Models whose control images ai-toolkit passes unresized, which its loader therefore leaves unflipped.
RAW_CONTROL_ARCHES = frozenset(
    {"qwen_image_edit_plus", "flux2", "flux2_klein_4b", "flux2_klein_9b", "boogu_image_edit", "mageflow_edit"}
) | {"minimax_h3_ref2va"}
REFUSED = {
    "control_from_same_folder": "picks a random control from the target's folder",
    "mask_path": "is a loss mask folder this route does not read",
    "inpaint_path": "is an inpainting layout",
    "alpha_mask": "reads the loss mask from the alpha channel",
    "unconditional_path": "pairs unconditional images",
    "clip_image_path": "pairs CLIP vision images",
    "clip_image_from_same_folder": "pairs CLIP vision images",
    "is_reg": "is a regularisation set ai-toolkit trains in a loader of its own",
}


def _stem(path: Path) -> str:
    return os.path.splitext(path.name)[0]


def targets_in(folder: Path) -> list[Path]:
    """The images ai-toolkit trains on under `folder`: hidden and `_controls` entries left out, ordered by path."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if Path(root).name == "_controls":
            continue
        found += [Path(root) / f for f in files if f.lower().endswith(EXTENSIONS) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def prompt_of(caption: str, trigger: str | None) -> str:
    """The caption as ai-toolkit hands it to the text encoder (its deterministic steps)."""
    prompt = ", ".join(caption.split(","))
    for token in ("[name]", "[trigger]"):
        prompt = prompt.replace(token, trigger or "")
    if trigger and trigger.strip() and trigger not in prompt:
        prompt = f"{trigger} {prompt}"
    return prompt


class AiToolkitSource(PairedFileSource):
    """One ai-toolkit data set: targets under `folder_path`, captions beside them, controls matched by name."""

    def __init__(
        self,
        folder: Path,
        control_folders: list[Path],
        caption_ext: str,
        default_caption: str | None,
        trigger: str | None,
        controls_per_sample: int | None,
        provenance: Mapping[str, Any],
        flips: Flips | None = None,
    ) -> None:
        for name, path in [("folder_path", folder), *(("control_path", c) for c in control_folders)]:
            if not path.is_dir():
                raise FileNotFoundError(f"{name}: {path} is not a directory")
        self.folder = folder
        targets = targets_in(folder)
        # Controls are found by name alone, so two targets with one name would share them; a caption
        # file is per folder, so a name shared up to case or extension in one folder shares it too.
        clashes = (
            case_clashes(targets, _stem) if control_folders else case_clashes(targets, lambda p: p.with_suffix(""))
        )
        listings = {
            c: [p for p in c.iterdir() if p.is_file() and p.name.lower().endswith(EXTENSIONS)] for c in control_folders
        }
        self.claimed: set[Path] = set()
        pairings = (flips or Flips()).copies(
            [
                self._pairing(t, clashes, listings, caption_ext, default_caption, trigger, controls_per_sample)
                for t in targets
            ]
        )
        for files in listings.values():
            for control in sorted(set(files) - self.claimed):
                problem = f"control image {control.name} matches no target under {folder} (same name, any extension)"
                pairings.append(refused(str(control), _stem(control), UNPAIRED_CONTROL, problem))
        super().__init__(pairings, provenance, "control_path: no control image for this target")

    def _pairing(
        self,
        target: Path,
        clashes: dict[Path, Path],
        listings: dict[Path, list[Path]],
        caption_ext: str,
        default_caption: str | None,
        trigger: str | None,
        expected: int | None,
    ) -> Pairing:
        where, stem = str(target), _stem(target)
        if target in clashes:
            other = clashes[target]
            problem = f"{target} and {other} share the name {stem} up to case or extension (their controls or caption)"
            return refused(where, stem, AMBIGUOUS_NAME, problem)
        controls = []
        for folder, files in listings.items():
            exact = [folder / (stem + ext) for ext in EXTENSIONS if (folder / (stem + ext)) in files]
            if len(exact) > 1:
                problem = f"{' and '.join(p.name for p in exact)} in {folder} both name the control of {target.name}"
                return refused(where, stem, AMBIGUOUS_NAME, problem)
            if not exact:
                near = [p.name for p in files if _stem(p).casefold() == stem.casefold()]
                detail = (
                    f" ({', '.join(near)} differs in case or extension: ai-toolkit would not find it)" if near else ""
                )
                return refused(where, stem, NO_CONTEXT, f"no control image for {target.name} in {folder}{detail}")
            self.claimed.add(exact[0])
            controls.append(exact[0])
        if expected is not None and len(controls) != expected:
            return refused(where, stem, CONTROL_COUNT, f"expected {expected} control(s), got {len(controls)}")
        caption_file = Path(os.path.splitext(target)[0] + caption_ext)
        caption = caption_file.read_text(encoding="utf-8") if caption_file.is_file() else None
        if not caption or not caption.strip():
            if default_caption is None:
                what = "does not exist" if caption is None else "is empty"
                problem = f"caption file {caption_file} {what} and the data set has no default_caption"
                if not caption_ext.startswith("."):
                    problem += f" (caption_type {caption_ext!r} is used as written: ai-toolkit adds no dot to it)"
                return refused(where, stem, MISSING_CAPTION, problem)
            caption = default_caption
        sample_id = os.path.splitext(target.relative_to(self.folder).as_posix())[0]
        return Pairing(where, sample_id, target, tuple(controls), prompt_of(caption, trigger))


def read_config(path: str | Path, controls_per_sample: int | None = None) -> list[ConfigDataset]:
    """Every `datasets:` entry of an ai-toolkit job config's processes, in order, as an edit source."""
    config_path = Path(path)
    job = ai_toolkit_file.load(config_path)
    processes = job["config"].get("process")
    if not isinstance(processes, list):
        raise ValueError(f"{config_path}: expected config.process, a list of processes, as ai-toolkit jobs have")
    entries = []
    for p, process in enumerate(processes):
        process = process or {}
        for d, entry in enumerate(process.get("datasets") or []):
            entries.append((f"{config_path}: config.process[{p}].datasets[{d}]", process, entry))
    if not entries:
        raise ValueError(f"{config_path}: no process has datasets")
    return [
        _dataset(i, where, process, entry, controls_per_sample) for i, (where, process, entry) in enumerate(entries)
    ]


def raw_control_images(process: Mapping[str, Any]) -> bool:
    """Whether the process's model takes its control images unresized (and so unflipped), as ai-toolkit's
    `use_raw_control_images` models do."""
    model = process.get("model") or {}
    arch = str(model.get("arch") or "").split(":")[0]
    return arch in RAW_CONTROL_ARCHES or (arch == "krea2" and bool((model.get("model_kwargs") or {}).get("edit")))


def _dataset(
    index: int, where: str, process: Mapping[str, Any], entry: Any, controls_per_sample: int | None
) -> ConfigDataset:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping of dataset options, got {entry!r}")
    for key, why in REFUSED.items():
        if entry.get(key):
            raise ValueError(f"{where}: {key} {why}; this layout is not read (remove it or build that set otherwise)")
    if entry.get("type", "image") != "image" or int(entry.get("num_frames", 1)) > 1:
        raise ValueError(f"{where}: only image data sets are read (type image, num_frames 1)")
    folder_value = entry.get("dataset_path") or entry.get("folder_path")
    if not isinstance(folder_value, str) or not folder_value:
        raise ValueError(f"{where}: folder_path: expected a folder of images, got {folder_value!r}")
    folder = absolute(folder_value)
    if folder.is_file():
        raise ValueError(f"{where}: dataset_path {folder} is a JSON caption file; this route reads folders")
    caption_ext = entry.get("caption_ext", ".txt")
    if caption_ext and isinstance(caption_ext, str) and not caption_ext.startswith("."):
        caption_ext = "." + caption_ext  # ai-toolkit adds the dot to caption_ext, but not to the legacy caption_type
    caption_ext = entry.get("caption_type") or caption_ext
    if not isinstance(caption_ext, str):
        raise ValueError(f"{where}: caption_ext: expected a file extension like .txt, got {caption_ext!r}")
    numbered = [entry.get(f"control_path_{n}") for n in (1, 2, 3)]
    control = [c for c in numbered if c] if any(numbered) else entry.get("control_path") or []
    control_folders = [absolute(c) for c in ([control] if isinstance(control, str) else control)]
    repeats, resolution = entry.get("num_repeats", 1), entry.get("resolution", 512)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{where}: num_repeats: expected a positive integer, got {repeats!r}")
    resolutions = len(resolution) if isinstance(resolution, list) else 1
    trigger = entry.get("trigger_word") or process.get("trigger_word")
    flips = Flips(bool(entry.get("flip_x")), bool(entry.get("flip_y")), not raw_control_images(process))
    provenance: dict[str, Any] = {"kind": "ai-toolkit", "config": where, "path": str(folder), **flips.to_json()}
    if controls_per_sample is not None:
        provenance["controls_per_sample"] = controls_per_sample
    source = AiToolkitSource(
        folder,
        control_folders,
        caption_ext,
        entry.get("default_caption"),
        trigger,
        controls_per_sample,
        provenance,
        flips,
    )
    why = f"num_repeats {repeats}" + (f" x {resolutions} resolutions" if resolutions > 1 else "")
    return ConfigDataset(dataset_name(index, folder), source, repeats * resolutions, why)
