"""What a cache build reads raw edit examples from: the source interface, its errors, and a sequence source.

A source is read by position (0-based) so a build can give each rank a disjoint slice and resume
where it stopped; `location(position)` names the manifest line or data set row for messages.
A sample's row index names its payload and orders the index: its position, unless the source says
otherwise (a manifest line's `metadata.row_index`, as NeMo Automodel's preprocessor reads it).
Anything wrong with one example raises `BadSampleError`, which the build stops on or skips. A source
yields examples without context images as they are; the build refuses them unless it writes
text-to-image rows (`BuildOptions.allow_no_context`), with the source's `missing_context` problem.
A JSONL manifest is read by `manifest.py`, a Hugging Face data set by `hf.py`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from PIL import Image, ImageOps

from ...errors import message_parts
from .records import RawEditSample

# Kinds of bad input, used to count skipped samples by reason.
INVALID_ENTRY = "invalid entry"
MISSING_IMAGE = "missing image"
UNREADABLE_IMAGE = "unreadable image"
EMPTY_PROMPT = "empty prompt"
NO_TARGET = "no target"
NO_CONTEXT = "no context"
DUPLICATE_ID = "duplicate id"
DUPLICATE_ROW_INDEX = "duplicate row index"
PATH_OUTSIDE = "path outside source directory"
MISALIGNED_IMAGE = "misaligned image"


class BadSampleError(ValueError):
    """One raw example cannot be used; says where it is (`location`), what kind of problem and why.

    Made from its parts, or from one message (`"location: problem"`, the kind then unknown), as
    every error type of the package can be (`errors.py`).
    """

    def __init__(self, location: str, kind: str | None = None, problem: str | None = None) -> None:
        if kind is None and problem is None:
            message = location
            location, problem = message_parts(message, type(self), 2)
        else:
            message = f"{location}: {problem}"
        super().__init__(message)
        self.location = location
        self.kind = kind or ""
        self.problem = problem or ""


@dataclass(frozen=True)
class SourceRecord:
    """A raw example with its stable position and the entries a payload passes through."""

    position: int
    location: str  # e.g. "edits.jsonl line 7" or "train.parquet row 12"
    sample: RawEditSample
    media: tuple[Mapping[str, Any], ...] = ()  # the manifest's media entries: role and file name
    given_row_index: int | None = None  # the manifest's metadata.row_index, if it gives one
    # What is wrong with a record without context images when a build does not allow text-to-image rows.
    missing_context: str = "contexts: expected at least one context image, got none"

    @property
    def row_index(self) -> int:
        """The index that names the payload and orders the index: the given one, else the position."""
        return self.position if self.given_row_index is None else self.given_row_index


@runtime_checkable
class EditSource(Protocol):
    """What a cache build reads: a fixed number of examples, each by position.

    A source whose row indices are not its positions also has `row_index(position) -> int`, cheap
    (without opening images), equal to `read(position).row_index` and unique over the source.
    """

    def __len__(self) -> int: ...

    def read(self, position: int) -> SourceRecord:
        """The example at `position`; raises `BadSampleError` if it cannot be used."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON provenance (kind, path, columns, row count); a resumed build must see the same."""
        ...


def row_index_of(source: EditSource, position: int) -> int:
    """The row index of `position`: the source's `row_index(position)` if it defines one, else the position."""
    lookup = getattr(source, "row_index", None)
    return int(lookup(position)) if callable(lookup) else position


def open_image(data: bytes | str | Path, location: str, field: str, mode: str | None = "RGB") -> Image.Image:
    """Decode an image file or bytes fully into `mode` (None: its own mode, alpha kept), honouring EXIF orientation."""
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as opened:
            opened.load()  # decoded now, so the image outlives its file
            ImageOps.exif_transpose(opened, in_place=True)
            # No copy when the mode is right already: a megapixel copy costs as much as the pixels do later.
            image: Image.Image = opened.convert(mode) if mode is not None and opened.mode != mode else opened
    except FileNotFoundError:
        raise BadSampleError(location, MISSING_IMAGE, f"{field}: file {str(data)!r} does not exist") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        what = "bytes" if isinstance(data, bytes) else f"file {str(data)!r}"
        raise BadSampleError(location, UNREADABLE_IMAGE, f"{field}: {what} is not a readable image ({error})") from None
    return image


def inside(root: Path, relative: str, location: str, field: str) -> Path:
    """Resolve `relative` under `root` (following symlinks) and refuse a path that leaves it."""
    resolved = Path(os.path.realpath(os.path.join(root, relative)))
    if root != resolved and root not in resolved.parents:
        raise BadSampleError(
            location, PATH_OUTSIDE, f"{field}: {relative!r} resolves to {resolved}, outside the directory {root}"
        )
    return resolved


def first_positions(ids: Sequence[Hashable | None]) -> dict[int, int]:
    """For each position whose id was already used, the position that used it first."""
    seen: dict[Hashable, int] = {}
    repeats: dict[int, int] = {}
    for position, sample_id in enumerate(ids):
        if sample_id is None:
            continue
        if sample_id in seen:
            repeats[position] = seen[sample_id]
        else:
            seen[sample_id] = position
    return repeats


class IndexedSamples(Protocol):
    """A sized collection of examples read by index, like `DemoSource` or a list."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> RawEditSample: ...


class SequenceSource:
    """Any sized, indexable collection of `RawEditSample`, such as `DemoSource`."""

    def __init__(self, samples: IndexedSamples, provenance: Mapping[str, Any]) -> None:
        """
        Args:
            samples: The examples; `samples[i]` must always return the same example.
            provenance: JSON description recorded in metadata.json (e.g. generator name and seed).
        """
        self.samples = samples
        self.provenance = dict(provenance)

    def __len__(self) -> int:
        return len(self.samples)

    def location(self, position: int) -> str:
        """`<kind> sample <position>`."""
        return f"{self.provenance.get('kind', 'source')} sample {position}"

    def read(self, position: int) -> SourceRecord:
        """The example at `position`; refuses an empty prompt (a build refuses one without contexts unless allowed)."""
        sample = self.samples[position]
        where = self.location(position)
        if not sample.prompt.strip():
            raise BadSampleError(where, EMPTY_PROMPT, f"prompt: expected text, got {sample.prompt!r}")
        return SourceRecord(position, where, sample)

    def describe(self) -> dict[str, Any]:
        """The provenance given at construction, plus the row count."""
        return {**self.provenance, "rows": len(self)}
