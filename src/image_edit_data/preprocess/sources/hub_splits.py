"""Which split each parquet file of a local Hugging Face data set belongs to, named as the hub names splits.

A folder downloaded from the hub (or written by `push_to_hub` / `to_parquet`) keeps every split side by side,
so the files are grouped by the hub's naming rules before any row is read, first rule that applies:

1. the sharded file names the hub writes: `<split>-NNNNN-of-NNNNN*.parquet` directly in the folder or in its
   `data/` (MagicBrush's `data/train-00000-of-00051-....parquet` and `data/dev-...`: splits `train`, `dev`);
2. one folder per split: `data/<split>/...` (or `<split>/...` when the folder given is itself `data/`);
3. the `datasets` library's split keywords in a folder name, then in a file name (`train/`, `test.parquet`,
   `part-val-0.parquet`), grouped as it groups them: `train`/`training` as `train`;
   `validation`/`valid`/`dev`/`val` as `validation`; `test`/`testing`/`eval`/`evaluation` as `test`;
4. otherwise the files are one set without a split name, which the `datasets` library calls `train`
   (so `--split train` reads it, and any other split name is refused).

Where the `datasets` library would quietly leave out files that fit none of its rule's splits, a file that
carries no split name beside files that do is refused here, as is a file whose name fits two splits.
Hidden files and folders (`.` or `__` in front) are not data, as for the hub.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

SHARDED = re.compile(r"(?P<split>\w+(?:\.\w+)*)-[0-9]{5}-of-[0-9]{5}.*\.parquet")
SEPARATORS = "-._ 0-9"
KEYWORDS = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "dev": "validation",
    "val": "validation",
    "test": "test",
    "testing": "test",
    "eval": "test",
    "evaluation": "test",
}
_WORDS = "|".join(sorted(KEYWORDS, key=len, reverse=True))
# Lookarounds, so that one separator may close a keyword and open the next (`train_test.parquet`).
KEYWORD_FOLDER = re.compile(rf"(?:^|(?<=[{SEPARATORS}]))(?P<word>{_WORDS})(?=[{SEPARATORS}]|$)")
KEYWORD_FILE = re.compile(rf"(?:^|(?<=[{SEPARATORS}]))(?P<word>{_WORDS})(?=[{SEPARATORS}])")


def parquet_files(path: Path) -> list[Path]:
    """A parquet file itself, or every parquet file below a directory (hidden ones left out), in path order."""
    if path.is_file():
        return [path]
    files = sorted(
        p
        for p in path.rglob("*.parquet")
        if p.is_file() and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(f"{path}: no .parquet files here and no save_to_disk data set (state.json)")
    return files


def _sharded(root: Path, file: Path) -> set[str]:
    match = SHARDED.fullmatch(file.name)
    return {match["split"]} if match and file.parent in (root, root / "data") else set()


def _split_folder(root: Path, file: Path) -> set[str]:
    parts = file.relative_to(root).parts[:-1]
    if root.name == "data" and parts:
        return {parts[0]}
    return {parts[1]} if len(parts) >= 2 and parts[0] == "data" else set()


def _keyword_folder(root: Path, file: Path) -> set[str]:
    parts = file.relative_to(root).parts[:-1]
    return {KEYWORDS[m["word"]] for part in parts for m in KEYWORD_FOLDER.finditer(part)}


def _keyword_file(root: Path, file: Path) -> set[str]:
    return {KEYWORDS[m["word"]] for m in KEYWORD_FILE.finditer(file.name)}


RULES: tuple[tuple[str, Callable[[Path, Path], set[str]]], ...] = (
    ("file names <split>-NNNNN-of-NNNNN", _sharded),
    ("folders data/<split>/", _split_folder),
    ("split keywords in folder names", _keyword_folder),
    ("split keywords in file names", _keyword_file),
)


def parquet_splits(root: Path, files: Sequence[Path]) -> dict[str | None, list[Path]]:
    """The files of each split (key None: one set without a split name), by the first naming rule that applies.

    `root` is the folder the user gave (a file's own folder when a file was given).
    """
    for rule, split_of in RULES:
        found = {file: split_of(root, file) for file in files}
        if not any(found.values()):
            continue
        unnamed = [str(f.relative_to(root)) for f, names in found.items() if not names]
        if unnamed:
            raise ValueError(
                f"{root}: its parquet files are split by {rule}, but {unnamed[:5]} carry no split name "
                "(move them out, or give the split's own files as --dataset)"
            )
        ambiguous = {str(f.relative_to(root)): sorted(n) for f, n in found.items() if len(n) > 1}
        if ambiguous:
            raise ValueError(f"{root}: files named for more than one split by {rule}: {ambiguous}")
        splits: dict[str | None, list[Path]] = {}
        for file, names in found.items():
            splits.setdefault(next(iter(names)), []).append(file)
        return splits
    return {None: list(files)}


def choose_split(name: str, available: Sequence[str | None], split: str | None) -> str | None:
    """The key of the split to read (None: the set without split names): `split` if the data set has it, its only
    split if none is asked (`train` names a set without split names, as in `datasets`); else a clear error."""
    named = sorted(s for s in available if s is not None)
    if split is None:
        if len(available) == 1:
            return available[0]
        raise ValueError(f"{name}: holds the splits {named}; choose one with --split (splits are never read together)")
    if split in available:
        return split
    if not named:
        if split == "train":
            return None
        raise ValueError(
            f"{name}: split: {split!r} asked for, but the data set has no split names (the `datasets` library calls "
            "such a set train)"
        )
    hint = ""
    if split in KEYWORDS and KEYWORDS[split] in named and KEYWORDS[split] != split:
        hint = f" (the hub's naming files {split!r} under {KEYWORDS[split]!r})"
    raise ValueError(f"{name}: split: expected one of {named}, got {split!r}{hint}")
