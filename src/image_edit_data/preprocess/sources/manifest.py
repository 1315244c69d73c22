"""NeMo Automodel's JSONL image-edit manifest as an edit source (one JSON object per line)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from .base import (
    DUPLICATE_ID,
    DUPLICATE_ROW_INDEX,
    EMPTY_PROMPT,
    INVALID_ENTRY,
    MISSING_IMAGE,
    NO_TARGET,
    BadSampleError,
    SourceRecord,
    first_positions,
    inside,
    open_image,
)
from .records import RawEditSample


@dataclass(frozen=True)
class _Entry:
    """One parsed manifest line, or the reason it cannot be used."""

    line: int
    sample_id: str | None
    prompt: str = ""
    media: tuple[Mapping[str, Any], ...] = ()
    metadata: Mapping[str, Any] | None = None
    error: BadSampleError | None = None
    row_index: int | None = None  # metadata.row_index, when given


MEDIA_ROLES = ("target", "context", "condition", "mask")
MISSING_CONTEXT = "media: expected at least one entry with role 'context', got none"


class JsonlManifestSource:
    """NeMo Automodel's generic image-edit manifest: one JSON object per line.

    Each object has `id`, `prompt`, an ordered `media` list of `{"role": "target"|"context"|"condition"|"mask",
    "file_name": ...}` with paths relative to the manifest's directory, and an optional `metadata`
    object. Condition images are read for prompt encoders that look at them (Qwen-Image-Edit's
    Qwen2.5-VL); they are not VAE-encoded. A `mask` (at most one, the target's size, white = edited)
    becomes the sample's edit mask. A line without a `context` is a text-to-image row, which a build
    writes only when asked. Blank lines are ignored; positions count the other lines in order.
    As in NeMo Automodel, `metadata.row_index` (a filtered export keeps its original rows' numbers) is the
    row index, the position when absent, and must be unique; media entries keep only role and file name.
    """

    def __init__(self, manifest: str | Path) -> None:
        """
        Args:
            manifest: The .jsonl file; every image it names must lie inside its directory.
        """
        self.manifest = Path(manifest)
        if not self.manifest.is_file():
            raise FileNotFoundError(f"{self.manifest}: manifest file does not exist")
        self.root = Path(os.path.realpath(self.manifest.parent))
        self.name = str(manifest)
        entries: list[_Entry] = []
        with self.manifest.open("r", encoding="utf-8") as stream:
            for number, text in enumerate(stream, start=1):
                if text.strip():
                    entries.append(self._parse(number, text))
        repeats = first_positions([e.sample_id for e in entries])
        for position, first in repeats.items():
            entry = entries[position]
            if entry.error is None:
                problem = f"id: {entry.sample_id!r} is already used on line {entries[first].line}"
                error = BadSampleError(self._where(entry.line), DUPLICATE_ID, problem)
                entries[position] = _Entry(entry.line, entry.sample_id, error=error, row_index=entry.row_index)
        self.entries = entries
        # Row indices name payloads, so they must be unique: of two lines claiming one, the later is bad.
        claimed = [self.row_index(p) if e.error is None else None for p, e in enumerate(entries)]
        for position, first in first_positions(claimed).items():
            entry = entries[position]
            given = "" if entry.row_index is not None else "not given, so the position "
            problem = (
                f"metadata.row_index: {given}{claimed[position]} is already the row index of line {entries[first].line}"
            )
            error = BadSampleError(self._where(entry.line), DUPLICATE_ROW_INDEX, problem)
            entries[position] = _Entry(entry.line, entry.sample_id, error=error, row_index=entry.row_index)

    def __len__(self) -> int:
        return len(self.entries)

    def _where(self, line: int) -> str:
        return f"{self.name} line {line}"

    def location(self, position: int) -> str:
        """`<manifest> line <n>` of the entry at `position`."""
        return self._where(self.entries[position].line)

    def row_index(self, position: int) -> int:
        """The entry's `metadata.row_index`, or its position when it gives none."""
        given = self.entries[position].row_index
        return position if given is None else given

    def _parse(self, line: int, text: str) -> _Entry:
        """Check the fields of one line (images are opened later, in `read`)."""
        where = self._where(line)
        row_index: int | None = None  # once known, a bad line's row index is reported with it

        def bad(kind: str, problem: str, sample_id: str | None = None) -> _Entry:
            return _Entry(line, sample_id, error=BadSampleError(where, kind, problem), row_index=row_index)

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            return bad(INVALID_ENTRY, f"not valid JSON ({error.msg} at column {error.colno})")
        if not isinstance(obj, dict):
            return bad(INVALID_ENTRY, f"expected a JSON object, got {type(obj).__name__}")
        metadata = obj.get("metadata", {})
        given = metadata.get("row_index") if isinstance(metadata, dict) else None
        if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
            row_index = given
        raw_id = obj.get("id")
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
            return bad(INVALID_ENTRY, f"id: expected a non-empty string or integer, got {raw_id!r}")
        sample_id = str(raw_id)
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return bad(EMPTY_PROMPT, f"prompt: expected non-empty text, got {prompt!r}", sample_id)
        media = obj.get("media")
        if not isinstance(media, list):
            return bad(
                INVALID_ENTRY, f"media: expected a list of {{role, file_name}} objects, got {media!r}", sample_id
            )
        for i, item in enumerate(media):
            if not isinstance(item, dict) or item.get("role") not in MEDIA_ROLES:
                got = item.get("role") if isinstance(item, dict) else item
                problem = f"media[{i}].role: expected one of {', '.join(MEDIA_ROLES)}, got {got!r}"
                return bad(INVALID_ENTRY, problem, sample_id)
            if not isinstance(item.get("file_name"), str) or not item["file_name"]:
                problem = f"media[{i}].file_name: expected a non-empty path, got {item.get('file_name')!r}"
                return bad(INVALID_ENTRY, problem, sample_id)
        roles = [item["role"] for item in media]
        if roles.count("target") != 1:
            kind = NO_TARGET if "target" not in roles else INVALID_ENTRY
            return bad(
                kind, f"media: expected exactly one entry with role 'target', got {roles.count('target')}", sample_id
            )
        if roles.count("mask") > 1:
            problem = f"media: expected at most one entry with role 'mask', got {roles.count('mask')}"
            return bad(INVALID_ENTRY, problem, sample_id)
        if not isinstance(metadata, dict):
            return bad(INVALID_ENTRY, f"metadata: expected an object, got {type(metadata).__name__}", sample_id)
        if given is not None and row_index is None:
            return bad(INVALID_ENTRY, f"metadata.row_index: expected an integer >= 0, got {given!r}", sample_id)
        # Only role and file name pass on to the payload's metadata, as NeMo Automodel keeps them.
        kept = tuple({"role": item["role"], "file_name": item["file_name"]} for item in media)
        return _Entry(line, sample_id, prompt, kept, metadata, row_index=row_index)

    def read(self, position: int) -> SourceRecord:
        """Open the entry's images: the target, the contexts, the conditions (each in manifest order) and the mask."""
        entry = self.entries[position]
        if entry.error is not None:
            raise entry.error
        where = self._where(entry.line)
        target: Image.Image | None = None
        mask: Image.Image | None = None
        contexts: list[Image.Image] = []
        conditions: list[Image.Image] = []
        for i, item in enumerate(entry.media):
            field = f"media[{i}].file_name"
            path = inside(self.root, item["file_name"], where, field)
            if not path.is_file():
                raise BadSampleError(where, MISSING_IMAGE, f"{field}: {item['file_name']!r} does not exist ({path})")
            image = open_image(path, where, field)
            if item["role"] == "target":
                target = image
            elif item["role"] == "context":
                contexts.append(image)
            elif item["role"] == "mask":
                mask = image
            else:
                conditions.append(image)
        if target is None:  # unreachable after _parse, kept so the type is narrowed without assert
            raise BadSampleError(where, NO_TARGET, "media: no entry with role 'target'")
        sample = RawEditSample(
            entry.sample_id or "", entry.prompt, target, tuple(contexts), entry.metadata or {}, tuple(conditions), mask
        )
        return SourceRecord(position, where, sample, entry.media, entry.row_index, MISSING_CONTEXT)

    def describe(self) -> dict[str, Any]:
        """Kind, absolute manifest path and number of entries."""
        return {"kind": "jsonl", "path": str(self.manifest.resolve()), "rows": len(self)}
