"""SimpleTuner's `multidatabackend.json` as edit sources: each image data set paired with its conditioning data sets.

Read as SimpleTuner reads it (bghira/SimpleTuner `documentation/DATALOADER.md`, the FLUX Kontext and Qwen-Image-Edit
quickstarts; `helpers/data_backend/factory.py`, `multiaspect/sampler.py`, `prompts.py`):

- a JSON list of data sets; `disabled` (or `disable`) ones are left out; in strings `{env:VAR}` becomes the
  variable (empty when unset) and `{id}` the data set's id (`simpletuner_config.py`);
- an image data set (`dataset_type` image, the default) names its references in `conditioning_data` (an id or
  a list), each a data set of `dataset_type` conditioning; several are its contexts in that order, which is
  SimpleTuner's `conditioning_multidataset_sampling=combined` (its `random` picks one per sample per epoch,
  which a cache cannot hold, so it is refused);
- the targets are the image files below `instance_data_dir` (the extensions Pillow opens, any case, links
  followed), ordered by path (SimpleTuner shuffles); the reference of `sub/name.png` is `sub/name.png` below
  the conditioning data set's `instance_data_dir`: the same relative path, name and extension;
- the prompt by `caption_strategy` (`filename` when unset, SimpleTuner's default): `textfile` reads
  `sub/name.txt` beside the image as it is (a file of several lines is several captions unless
  `disable_multiline_split`), `filename` the file's stem with `_` as spaces, `instanceprompt` the
  `instance_prompt`; `prepend_instance_prompt` puts `instance_prompt` and a space in front, `only_instance_prompt`
  uses it alone;
- `minimum_image_size` leaves out targets too small for it, by `resolution_type` (`pixel_area` when unset);
- `repeats` (default 0) are extra passes: a data set is shown `1 + repeats` times per epoch.

Stricter than SimpleTuner, each a bad sample naming the files: a target without its reference (SimpleTuner
stops on it mid-training), a reference no target claims (it never trains), a caption file of several lines
(SimpleTuner picks one at random each time), a missing caption file, and a target under `minimum_image_size`
(SimpleTuner leaves it out, so `--on-bad-sample skip` gives its set). What would make the data set another
one at each step or epoch is refused, naming the key (remote data, generated conditioning, `max_num_samples`,
schedules, caption shuffles and filters, aspect-ratio bucket filters, regularisation data).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .base import NO_CONTEXT, BadSampleError, SourceRecord
from .paired import CONTROL_COUNT, UNPAIRED_CONTROL, ConfigDataset, PairedFileSource, Pairing, refused
from .simpletuner_config import ImageSet, SizeFilter, load

TOO_SMALL = "under minimum_image_size"
# Folders SimpleTuner's local backend never lists.
SKIPPED_FOLDERS = frozenset(
    {".Spotlight-V100", ".Trashes", ".fseventsd", ".TemporaryItems", ".zfs", ".ipynb_checkpoints"}
)


def image_extensions() -> tuple[str, ...]:
    """The file extensions Pillow opens, lower case: the image files SimpleTuner lists."""
    return tuple(sorted({e.lower() for e, f in Image.registered_extensions().items() if f in Image.OPEN}))


def images_below(folder: Path) -> list[Path]:
    """The image files below `folder` as SimpleTuner lists them (links followed, each folder once), in path order."""
    extensions, seen, found = image_extensions(), set(), []
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if d not in SKIPPED_FOLDERS]
        found += [Path(root) / f for f in files if f.lower().endswith(extensions)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


class SimpleTunerSource(PairedFileSource):
    """One image data set: its targets with their references, prompts made as SimpleTuner makes them."""

    def __init__(self, pairings: Sequence[Pairing], provenance: Mapping[str, Any], sizes: SizeFilter) -> None:
        super().__init__(pairings, provenance, "conditioning_data: the data set names no conditioning data set")
        self.sizes = sizes

    def read(self, position: int) -> SourceRecord:
        """The example, refused when its target is under `minimum_image_size`."""
        record = super().read(position)
        width, height = record.sample.target.size
        if self.sizes.too_small(width, height):
            problem = (
                f"target is {width}x{height} pixels, under minimum_image_size {self.sizes.minimum} "
                f"({self.sizes.resolution_type}): SimpleTuner leaves it out"
            )
            raise BadSampleError(record.location, TOO_SMALL, problem)
        return record


def read_config(
    path: str | Path, controls_per_sample: int | None = None, conditioning_sampling: str | None = None
) -> list[ConfigDataset]:
    """Every enabled image data set of a SimpleTuner `multidatabackend.json`, in order, as an edit source."""
    config_path = Path(path)
    image_sets, references = load(config_path, conditioning_sampling)
    claimed: dict[str, set[str]] = {ref: set() for ref in references}
    targets = {entry.id: images_below(entry.folder) for entry in image_sets}
    for entry in image_sets:
        for ref in entry.conditioning:
            claimed[ref] |= {t.relative_to(entry.folder).as_posix() for t in targets[entry.id]}
    reported: set[str] = set()
    built = []
    for index, entry in enumerate(image_sets):
        pairings = [_pairing(entry, target, references, controls_per_sample) for target in targets[entry.id]]
        for ref in entry.conditioning:
            if ref in reported:
                continue
            reported.add(ref)
            folder = references[ref]
            for control in images_below(folder):
                relative = control.relative_to(folder).as_posix()
                if relative not in claimed[ref]:
                    problem = f"reference image {relative} in {ref!r} matches no target (same relative path and name)"
                    pairings.append(refused(str(control), relative, UNPAIRED_CONTROL, problem))
        provenance: dict[str, Any] = {"kind": "simpletuner", "config": str(config_path.resolve()), "dataset": entry.id}
        if controls_per_sample is not None:
            provenance["controls_per_sample"] = controls_per_sample
        source = SimpleTunerSource(pairings, provenance | {"path": str(entry.folder)}, entry.sizes)
        why = f"repeats {entry.repeats} (1 + {entry.repeats} passes)"
        built.append(ConfigDataset(f"{index}_{entry.safe_id}", source, 1 + entry.repeats, why))
    return built


def _pairing(entry: ImageSet, target: Path, references: Mapping[str, Path], expected: int | None) -> Pairing:
    relative = target.relative_to(entry.folder).as_posix()
    where = str(target)
    contexts = []
    for ref in entry.conditioning:
        control = references[ref] / relative
        if not control.is_file():
            near = (
                sorted(p.name for p in control.parent.glob(glob.escape(control.stem) + ".*"))
                if control.parent.is_dir()
                else []
            )
            detail = f" ({', '.join(near)} differs in extension: SimpleTuner pairs the exact name)" if near else ""
            problem = f"no reference image {relative} in {ref!r} ({references[ref]}){detail}"
            return refused(where, relative, NO_CONTEXT, problem)
        contexts.append(control)
    if expected is not None and len(contexts) != expected:
        return refused(where, relative, CONTROL_COUNT, f"expected {expected} reference(s), got {len(contexts)}")
    try:
        prompt = entry.captions.prompt(target)
    except BadSampleError as error:
        return Pairing(where, relative, error=error)
    return Pairing(where, relative, target, tuple(contexts), prompt)
