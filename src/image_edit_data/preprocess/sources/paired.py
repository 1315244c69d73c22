"""What the trainers' layouts have in common: examples named by files (a target, ordered contexts, a prompt).

Each peer layout (`musubi.py`, `ai_toolkit.py`, `diffsynth.py`) pairs its files once, when it opens, into a
list of `Pairing`s: the files of one example, or the `BadSampleError` that says why they cannot be one. A
`PairedFileSource` reads them by position like any `EditSource`; its images open in `read`, so an unreadable
file is a bad sample of its own. Files the layout names but pairs with nothing (a control image without a
target) come after the examples as positions that always raise, so a build stops on them or counts them.
A config naming several data sets (musubi-tuner's, ai-toolkit's, SimpleTuner's) opens as `ConfigDataset`s.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from .base import EMPTY_PROMPT, MISSING_IMAGE, BadSampleError, EditSource, SourceRecord, open_image
from .records import RawEditSample

# More kinds of bad input, for the counts of skipped samples.
MISSING_CAPTION = "missing caption"
UNPAIRED_CONTROL = "control without target"
AMBIGUOUS_NAME = "ambiguous file name"
CONTROL_COUNT = "wrong number of controls"


@dataclass(frozen=True)
class Pairing:
    """One example as a layout names it: its files and prompt, or the reason it cannot be used."""

    location: str  # e.g. "edits/img1.png" or "metadata.jsonl line 3"
    sample_id: str
    target: Path | None = None
    contexts: tuple[Path, ...] = ()
    prompt: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    error: BadSampleError | None = None
    flips: tuple[str, ...] = ()  # "x" / "y": mirror the images on read (`flips.py`)
    flip_contexts: bool = True  # whether the flips mirror the contexts too, or only the target


def mirrored(image: Image.Image, flips: tuple[str, ...]) -> Image.Image:
    """`image` mirrored left-right for each "x" and top-bottom for each "y" in `flips`."""
    for axis in flips:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT if axis == "x" else Image.Transpose.FLIP_TOP_BOTTOM)
    return image


def refused(location: str, sample_id: str, kind: str, problem: str) -> Pairing:
    """A position that raises `kind: problem` when read."""
    return Pairing(location, sample_id, error=BadSampleError(location, kind, problem))


class PairedFileSource:
    """Examples whose images are files a layout paired: read by position, each image opened on read."""

    def __init__(self, pairings: Sequence[Pairing], provenance: Mapping[str, Any], missing_context: str) -> None:
        """
        Args:
            pairings: The examples in the layout's order, then the positions that only report a problem.
            provenance: JSON description for metadata.json (kind, path, ...); a resumed build must see the same.
            missing_context: What an example without context images lacks, in the layout's words.
        """
        self.pairings = list(pairings)
        self.provenance = dict(provenance)
        self.missing_context = missing_context

    def __len__(self) -> int:
        return len(self.pairings)

    def location(self, position: int) -> str:
        """Where the example at `position` is named."""
        return self.pairings[position].location

    def read(self, position: int) -> SourceRecord:
        """Open the example's target and contexts (in order); raises its pairing problem if it has one."""
        pairing = self.pairings[position]
        if pairing.error is not None:
            raise pairing.error
        where = pairing.location
        if pairing.target is None:  # a pairing without error always has a target; narrowed without assert
            raise BadSampleError(where, MISSING_IMAGE, "no target image")
        if not pairing.prompt.strip():
            raise BadSampleError(where, EMPTY_PROMPT, f"prompt: expected text, got {pairing.prompt!r}")
        target = mirrored(self._open(pairing.target, where, "target"), pairing.flips)
        contexts = tuple(
            mirrored(self._open(p, where, f"context {i}"), pairing.flips if pairing.flip_contexts else ())
            for i, p in enumerate(pairing.contexts)
        )
        media = (
            {"role": "target", "file_name": str(pairing.target)},
            *({"role": "context", "file_name": str(p)} for p in pairing.contexts),
        )
        sample = RawEditSample(pairing.sample_id, pairing.prompt, target, contexts, dict(pairing.metadata))
        return SourceRecord(position, where, sample, media, missing_context=self.missing_context)

    @staticmethod
    def _open(path: Path, where: str, field: str) -> Image.Image:
        if not path.is_file():
            raise BadSampleError(where, MISSING_IMAGE, f"{field}: file {str(path)!r} does not exist")
        return open_image(path, where, field)

    def describe(self) -> dict[str, Any]:
        """The provenance given at construction, plus the number of positions."""
        return {**self.provenance, "rows": len(self)}


@dataclass(frozen=True)
class ConfigDataset:
    """One data set of a trainer's config: its source and how many times the trainer shows it per epoch."""

    name: str  # unique within the config, usable as a directory name
    source: EditSource
    repeats: int  # passes over each sample per epoch (ai-toolkit: x its resolutions; SimpleTuner: 1 + repeats)
    why: str  # how `repeats` follows from the config, e.g. "num_repeats 2"


def absolute(path: str | Path) -> Path:
    """`path` made absolute against the working directory, as the trainers open relative paths (links kept)."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def dataset_name(index: int, path: str | Path) -> str:
    """`<index>_<last part of path>`, with characters unsafe in a directory name replaced."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(path)).stem or "data").strip("-") or "data"
    return f"{index}_{stem}"


def case_clashes(paths: Sequence[Path], key: Any) -> dict[Path, Path]:
    """For each path whose `key(path).casefold()` another path shares, the first other path with it."""
    groups: dict[str, list[Path]] = {}
    for path in paths:
        groups.setdefault(str(key(path)).casefold(), []).append(path)
    clashes: dict[Path, Path] = {}
    for group in groups.values():
        for path in group if len(group) > 1 else ():
            clashes[path] = next(other for other in group if other != path)
    return clashes
