"""A local Hugging Face `datasets` data set (a `save_to_disk` directory or parquet files) as an edit source.

Columns are mapped by name, e.g. InstructPix2Pix: target `edited_image`, contexts `[original_image]`, prompt
`edit_prompt` (`hf_presets.py` names the public sets' columns, and their masks' own forms: `masks.py`).
A folder of parquet files is read one split at a time, split as the hub names them (`hub_splits.py`).
Image cells may be PIL images, `{"bytes": ..., "path": ...}` structs or raw bytes; image columns are
read undecoded so a broken image is reported as a bad row instead of failing the whole read.
Nothing is downloaded: only local paths are opened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from .base import (
    DUPLICATE_ID,
    EMPTY_PROMPT,
    INVALID_ENTRY,
    NO_CONTEXT,
    NO_TARGET,
    UNREADABLE_IMAGE,
    BadSampleError,
    SourceRecord,
    first_positions,
    inside,
    open_image,
)
from .hub_splits import choose_split, parquet_files, parquet_splits
from .masks import MaskForm, build_mask
from .records import RawEditSample

JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class ColumnMap:
    """Which data set column holds which part of an edit example."""

    target_column: str
    context_columns: tuple[str, ...]
    prompt_column: str
    id_column: str | None = None
    metadata_columns: tuple[str, ...] = ()
    condition_columns: tuple[str, ...] = ()
    mask_column: str | None = None
    prompt_item: int | None = None  # a prompt cell holding a list of phrasings: use this one (OmniEdit's)
    mask_form: MaskForm = "grey"  # how the set draws its masks (`masks.py`)

    def to_json(self) -> dict[str, Any]:
        """Provenance form (without `condition_columns` when empty, `mask_column`, `prompt_item` when unset and
        `mask_form` when grey, as written before they were read)."""
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if not self.condition_columns:
            del data["condition_columns"]
        for name in ("mask_column", "prompt_item"):
            if data[name] is None:
                del data[name]
        if self.mask_form == "grey" or self.mask_column is None:
            del data["mask_form"]
        return data


def _empty(cell: Any) -> bool:
    """A cell without an image: None or an empty list."""
    return cell is None or (isinstance(cell, (list, tuple)) and not cell)


class HFDatasetSource:
    """Rows of a local Hugging Face data set, with a column mapping."""

    def __init__(
        self,
        path: str | Path,
        target_column: str,
        context_columns: Sequence[str],
        prompt_column: str,
        id_column: str | None = None,
        split: str | None = None,
        metadata_columns: Sequence[str] = (),
        hf_cache_dir: str | None = None,
        condition_columns: Sequence[str] = (),
        mask_column: str | None = None,
        prompt_item: int | None = None,
        optional_columns: Sequence[str] = (),
        preset: str | None = None,
        mask_form: MaskForm = "grey",
    ) -> None:
        """
        Args:
            path: A `save_to_disk` directory, a parquet file, or a directory of parquet files.
            target_column: Column holding the edited (target) image.
            context_columns: Columns holding the context images, in order; a cell may hold a list of images. A row
                whose context cells are all empty (or no columns) is a text-to-image row, which a build writes only
                when asked; a row with some empty is a bad sample.
            prompt_column: Column holding the edit instruction.
            id_column: Column holding a unique sample id; without it the row number is the id.
            split: The split to read (`hub_splits.py` says how a folder of parquet files is split); required when
                the data set holds several, refused when it holds no split of that name.
            metadata_columns: Columns copied into each payload's `manifest_metadata`.
            hf_cache_dir: Where `datasets` may write the Arrow files it converts parquet into.
            condition_columns: Columns holding condition images for prompt encoders (a cell may hold a list
                or be empty); they are not VAE-encoded.
            mask_column: Column holding the edit-region mask; an empty cell leaves that row unmasked unless the
                mask form says otherwise.
            prompt_item: When the prompt cell is a list of phrasings (OmniEdit's `edited_prompt_list`), the one to use.
            optional_columns: Metadata or mask columns left out of the mapping when the data set lacks them (a preset
                names columns that only some versions of a set have).
            preset: The name of the preset that chose these columns, recorded in the provenance.
            mask_form: How the mask column draws a mask (`masks.py`): `grey` (white = edited, the target's size),
                or a set's own form (`magicbrush`, `ultraedit`).
        """
        import datasets

        self.path = Path(path)
        self.name = str(path)
        self.preset = preset
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: data set path does not exist")
        self.root = Path(os.path.realpath(self.path if self.path.is_dir() else self.path.parent))
        if (self.path / "state.json").is_file() or (self.path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(self.path))
            if isinstance(loaded, datasets.DatasetDict):
                split = choose_split(self.name, list(loaded), split)
                loaded = loaded[str(split)]
            else:
                key = choose_split(self.name, [None if loaded.split is None else str(loaded.split)], split)
                split = split if key is None else key
        else:
            root = self.path if self.path.is_dir() else self.path.parent
            by_split = parquet_splits(root, parquet_files(self.path))
            key = choose_split(self.name, list(by_split), split)
            loaded = datasets.Dataset.from_parquet([str(p) for p in by_split[key]], cache_dir=hf_cache_dir)
            split = split if key is None else key
        self.split = split
        present, optional = set(loaded.column_names), set(optional_columns)
        metadata_columns = [c for c in metadata_columns if c in present or c not in optional]
        if mask_column is not None and mask_column in optional and mask_column not in present:
            mask_column = None
        self.columns = ColumnMap(
            target_column,
            tuple(context_columns),
            prompt_column,
            id_column,
            tuple(metadata_columns),
            tuple(condition_columns),
            mask_column,
            prompt_item,
            mask_form,
        )
        names = [target_column, *context_columns, prompt_column, *metadata_columns, *condition_columns]
        missing = [c for c in [*names, id_column, mask_column] if c is not None and c not in loaded.column_names]
        if missing:
            raise ValueError(f"{self.name}: columns {missing} not found; the data set has {loaded.column_names}")
        for column in (target_column, *context_columns, *condition_columns, *([mask_column] if mask_column else [])):
            if isinstance(loaded.features[column], datasets.Image):
                loaded = loaded.cast_column(column, datasets.Image(decode=False))
        self.dataset = loaded
        ids = [None if v is None else str(v) for v in loaded[id_column]] if id_column else []
        self.repeats = first_positions(ids)

    def __len__(self) -> int:
        return len(self.dataset)

    def location(self, position: int) -> str:
        """`<path> row <n>` (0-based row of the data set)."""
        return f"{self.name} row {position}"

    def read(self, position: int) -> SourceRecord:
        """Decode the row's images and check its prompt, target, contexts and id."""
        where = self.location(position)
        if position in self.repeats:
            raise BadSampleError(
                where, DUPLICATE_ID, f"{self.columns.id_column}: id is already used by row {self.repeats[position]}"
            )
        row = self.dataset[position]
        id_column = self.columns.id_column
        sample_id = str(position) if id_column is None else row[id_column]
        if isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)) or sample_id == "":
            raise BadSampleError(
                where, INVALID_ENTRY, f"{id_column}: expected a non-empty string or integer id, got {sample_id!r}"
            )
        prompt = row[self.columns.prompt_column]
        item = self.columns.prompt_item
        if item is not None and isinstance(prompt, (list, tuple)):
            if len(prompt) <= item:
                problem = f"expected at least {item + 1} prompt(s) in the list, got {prompt!r}"
                raise BadSampleError(where, EMPTY_PROMPT, f"{self.columns.prompt_column}: {problem}")
            prompt = prompt[item]
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadSampleError(
                where, EMPTY_PROMPT, f"{self.columns.prompt_column}: expected non-empty text, got {prompt!r}"
            )
        target_column = self.columns.target_column
        if row[target_column] is None:
            raise BadSampleError(where, NO_TARGET, f"{target_column}: expected an image, got None")
        target = self._image(row[target_column], where, target_column)
        contexts: list[Image.Image] = []
        empty = [c for c in self.columns.context_columns if _empty(row[c])]
        if empty and len(empty) < len(self.columns.context_columns):  # only a row without any context is text-to-image
            column = empty[0]
            raise BadSampleError(where, NO_CONTEXT, f"{column}: expected a context image, got {row[column]!r}")
        for column in self.columns.context_columns:
            cell = row[column]
            if _empty(cell):
                continue
            if isinstance(cell, (list, tuple)):
                contexts.extend(self._image(c, where, f"{column}[{i}]") for i, c in enumerate(cell))
            else:
                contexts.append(self._image(cell, where, column))
        conditions: list[Image.Image] = []
        for column in self.columns.condition_columns:
            cell = row[column]
            cells = [] if cell is None else list(cell) if isinstance(cell, (list, tuple)) else [cell]
            conditions.extend(self._image(c, where, f"{column}[{i}]") for i, c in enumerate(cells))
        mask_column = self.columns.mask_column
        mask = None
        if mask_column is not None:
            cell, form = row[mask_column], self.columns.mask_form
            drawn = None if cell is None else self._image(cell, where, mask_column, None if form != "grey" else "RGB")
            mask = build_mask(drawn, target.size, form, where, mask_column)
        metadata = {c: self._plain(row[c]) for c in self.columns.metadata_columns}
        sample = RawEditSample(str(sample_id), prompt, target, tuple(contexts), metadata, tuple(conditions), mask)
        if self.columns.context_columns:
            first = self.columns.context_columns[0]
            missing = f"{first}: expected a context image, got {row[first]!r}"
        else:
            missing = "context_columns: expected a context image column, got none"
        return SourceRecord(position, where, sample, missing_context=missing)

    def _image(self, cell: Any, where: str, field: str, mode: str | None = "RGB") -> Image.Image:
        """A PIL image (in `mode`; None keeps its own) from a decoded image, a `{"bytes", "path"}` struct or bytes."""
        if isinstance(cell, Image.Image):
            return cell.convert(mode) if mode is not None else cell.copy()
        if isinstance(cell, (bytes, bytearray)):
            return open_image(bytes(cell), where, field, mode)
        if isinstance(cell, dict) and cell.get("bytes"):
            return open_image(bytes(cell["bytes"]), where, field, mode)
        if isinstance(cell, dict) and isinstance(cell.get("path"), str) and cell["path"]:
            return open_image(inside(self.root, cell["path"], where, f"{field}.path"), where, field, mode)
        raise BadSampleError(
            where,
            UNREADABLE_IMAGE,
            f"{field}: expected an image, image bytes or {{'bytes': ...}}, got {type(cell).__name__}",
        )

    @staticmethod
    def _plain(value: Any) -> Any:
        """A JSON-safe copy of a metadata cell (anything else becomes its string form)."""
        if isinstance(value, JSON_SCALARS):
            return value
        if isinstance(value, (list, tuple)):
            return [HFDatasetSource._plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): HFDatasetSource._plain(v) for k, v in value.items()}
        return str(value)

    def describe(self) -> dict[str, Any]:
        """Kind, absolute path, split, column mapping and row count."""
        preset = {} if self.preset is None else {"preset": self.preset}
        return {
            "kind": "hf_dataset",
            **preset,
            "path": str(self.path.resolve()),
            "split": self.split,
            **self.columns.to_json(),
            "rows": len(self),
        }
