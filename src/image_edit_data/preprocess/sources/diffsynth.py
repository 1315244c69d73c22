"""DiffSynth-Studio's metadata file (CSV, JSON or JSONL) with its base path as an edit source.

As DiffSynth-Studio's `UnifiedDataset` reads it: `.json` is a list of objects, `.jsonl` one object a line,
anything else CSV with a header (a UTF-8 byte-order mark dropped, as pandas drops it). `image` is the target,
the context key (`edit_image` for Qwen-Image-Edit, `kontext_images` for FLUX.1 Kontext) one path or a list of
paths in order, `prompt` the instruction; a path is joined to the base path (`--dataset_base_path`) as
DiffSynth joins it, so an absolute one stays as it is. The other keys are kept as the payload's
`manifest_metadata`. `--dataset_repeat` is a training flag, not in the file, so a single cache is built.

Stricter than DiffSynth: a key the option names that no row has is refused at once (naming the keys
the file has); a row without its target, context or prompt, a URL (nothing is downloaded), a CSV cell
that looks like a list (CSV holds no lists: DiffSynth would open it as one file name) and, with
`controls_per_sample`, a list of another length are bad rows naming file and line or row.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import EMPTY_PROMPT, INVALID_ENTRY, NO_CONTEXT, NO_TARGET
from .paired import CONTROL_COUNT, PairedFileSource, Pairing, refused

TARGET_KEY = "image"
PROMPT_KEY = "prompt"
URL_PREFIXES = ("http://", "https://", "ftp://", "s3://", "gs://")


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the metadata file, in order; a row that does not parse is a string."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        for i, row in enumerate(data):
            yield f"{path} item {i}", row
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as stream:
            for number, text in enumerate(stream, start=1):
                if text.strip():
                    try:
                        yield f"{path} line {number}", json.loads(text)
                    except json.JSONDecodeError as error:
                        yield f"{path} line {number}", f"not valid JSON ({error.msg} at column {error.colno})"
    else:
        # pandas, which DiffSynth reads CSV with, drops a byte-order mark (Excel's "CSV UTF-8" writes one);
        # its JSON readers do not, so a marked .json or .jsonl is refused above as DiffSynth refuses it.
        with path.open(encoding="utf-8-sig", newline="") as stream:
            # Line 1 is the header, so data row i (0-based) is on line i + 2 unless a cell spans lines.
            for i, row in enumerate(csv.DictReader(stream)):
                yield f"{path} row {i} (line {i + 2})", {k: v for k, v in row.items() if k is not None}


class DiffSynthSource(PairedFileSource):
    """The rows of a DiffSynth-Studio metadata file, paths joined to its base path."""

    def __init__(
        self,
        metadata: str | Path,
        base_path: str | Path | None = None,
        context_key: str = "edit_image",
        controls_per_sample: int | None = None,
    ) -> None:
        """
        Args:
            metadata: The .csv, .json or .jsonl file.
            base_path: DiffSynth's `--dataset_base_path`; default the metadata file's directory.
            context_key: The key holding the context image path(s) (`edit_image`, `kontext_images`).
            controls_per_sample: If set, a row with another number of context images is bad.
        """
        path = Path(metadata)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: DiffSynth metadata file does not exist")
        root = Path(os.path.abspath(path.parent if base_path is None else base_path))
        if not root.is_dir():
            raise FileNotFoundError(f"base path {root} is not a directory")
        self.csv = path.suffix.lower() not in (".json", ".jsonl")
        rows = list(_rows(path))
        keys = {k for _, row in rows if isinstance(row, dict) for k in row}
        for name, key in (("target", TARGET_KEY), ("context", context_key), ("prompt", PROMPT_KEY)):
            if rows and key not in keys:
                raise ValueError(f"{path}: no row has the {name} key {key!r}; its keys are {sorted(keys)}")
        self.root, self.context_key, self.expected = root, context_key, controls_per_sample
        pairings = [self._pairing(where, row) for where, row in rows]
        provenance: dict[str, Any] = {
            "kind": "diffsynth",
            "path": str(path.resolve()),
            "base_path": str(root),
            "context_key": context_key,
        }
        if controls_per_sample is not None:
            provenance["controls_per_sample"] = controls_per_sample
        super().__init__(pairings, provenance, f"{context_key}: no context image on this row")

    def _pairing(self, where: str, row: Any) -> Pairing:
        """One row, checked (images open later)."""
        if isinstance(row, str):
            return refused(where, where, INVALID_ENTRY, row)
        if not isinstance(row, dict):
            return refused(where, where, INVALID_ENTRY, f"expected an object, got {type(row).__name__}")
        target = row.get(TARGET_KEY)
        if not isinstance(target, str) or not target:
            return refused(where, where, NO_TARGET, f"{TARGET_KEY}: expected a file path, got {target!r}")
        prompt = row.get(PROMPT_KEY)
        if not isinstance(prompt, str) or not prompt.strip():
            return refused(where, target, EMPTY_PROMPT, f"{PROMPT_KEY}: expected non-empty text, got {prompt!r}")
        cell = row.get(self.context_key)
        if cell is None or cell == "":
            return Pairing(where, target, self._path(target), (), prompt, self._metadata(row))
        values = cell if isinstance(cell, list) else [cell]
        if self.csv and isinstance(cell, str) and cell.lstrip().startswith("["):
            problem = f"{self.context_key}: {cell!r} looks like a list, which CSV cannot hold: use .json or .jsonl"
            return refused(where, target, INVALID_ENTRY, problem)
        for field, value in [(TARGET_KEY, target), *((self.context_key, v) for v in values)]:
            if not isinstance(value, str) or not value:
                return refused(where, target, NO_CONTEXT, f"{field}: expected a file path, got {value!r}")
            if value.startswith(URL_PREFIXES):
                return refused(where, target, INVALID_ENTRY, f"{field}: {value!r} is a URL; nothing is downloaded")
        if self.expected is not None and len(values) != self.expected:
            problem = f"{self.context_key}: expected {self.expected} image(s), got {len(values)}: {values}"
            return refused(where, target, CONTROL_COUNT, problem)
        contexts = tuple(self._path(v) for v in values)
        return Pairing(where, target, self._path(target), contexts, prompt, self._metadata(row))

    def _path(self, value: str) -> Path:
        # DiffSynth's ToAbsolutePath: os.path.join, so an absolute value stays as it is.
        return Path(os.path.join(self.root, value))

    def _metadata(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in (TARGET_KEY, PROMPT_KEY, self.context_key)}
