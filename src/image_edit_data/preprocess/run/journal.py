"""A build's progress on disk, so a killed or distributed build can be finished by rerunning it.

```
<cache_dir>/progress/
  settings.json       the settings the cache is built with; a rerun must use the same ones
  rank-00000.jsonl    append-only, one line per finished position of that rank
  rank-00001.failed   the error that stopped rank 1, so the merging rank stops waiting
```
A journal line is `{"position": p, "record": {...index record...}}` for a written payload or
`{"position": p, "skipped": {"location", "kind", "problem"}}` for a skipped bad sample. Lines are
appended after their payloads are on disk and fsynced once per window of samples: a position is
done exactly when its line is complete. A torn last line (from a kill) is cut off when that rank's
journal is reopened and ignored by readers until then.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._atomic import write_text_atomic

PROGRESS_DIR = "progress"
SETTINGS_FILE = "settings.json"
_OWN_ENTRIES = {PROGRESS_DIR, "samples", "metadata.json"}


def journal_path(root: Path, rank: int) -> Path:
    """The journal file of `rank`."""
    return root / PROGRESS_DIR / f"rank-{rank:05d}.jsonl"


def failure_path(root: Path, rank: int) -> Path:
    """The failure marker of `rank`."""
    return root / PROGRESS_DIR / f"rank-{rank:05d}.failed"


class Journal:
    """This rank's append-only journal."""

    def __init__(self, root: Path, rank: int) -> None:
        self.path = journal_path(root, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = self.path.open("ab")
        self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        """Drop a last line without its newline, left by a kill in the middle of an append."""
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self._stream.truncate(data.rfind(b"\n") + 1)
            self._stream.flush()
            os.fsync(self._stream.fileno())

    def append(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Append entries as lines and fsync them."""
        if not entries:
            return
        self._stream.write(b"".join(json.dumps(e, sort_keys=True).encode() + b"\n" for e in entries))
        self._stream.flush()
        os.fsync(self._stream.fileno())

    def close(self) -> None:
        """Close the file."""
        self._stream.close()


class JournalReader:
    """Every rank's journal, read incrementally: each `refresh` parses only the new complete lines."""

    def __init__(self, root: Path) -> None:
        self.directory = root / PROGRESS_DIR
        self.entries: dict[int, dict[str, Any]] = {}  # position -> latest entry
        self._offsets: dict[Path, int] = {}

    def refresh(self) -> dict[int, dict[str, Any]]:
        """Read new lines of every journal and return all entries by position."""
        for path in sorted(self.directory.glob("rank-*.jsonl")):
            for entry in self._new_lines(path):
                self.entries[int(entry["position"])] = entry
        return self.entries

    def _new_lines(self, path: Path) -> Iterator[dict[str, Any]]:
        offset = self._offsets.get(path, 0)
        with path.open("rb") as stream:
            stream.seek(offset)
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offsets[path] = offset + len(complete)
        for number, line in enumerate(complete.splitlines(), start=1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}: new line {number}: not valid JSON ({error.msg}); the journal is damaged, "
                    f"delete {path.parent} and the samples to rebuild"
                ) from None
            yield entry


def write_failure(root: Path, rank: int, message: str) -> None:
    """Leave a marker saying why `rank` stopped."""
    write_text_atomic(failure_path(root, rank), message)


def clear_failure(root: Path, rank: int) -> None:
    """Remove this rank's marker from an earlier run."""
    failure_path(root, rank).unlink(missing_ok=True)


def failures(root: Path, since: float) -> dict[int, str]:
    """Failure markers written at or after `since` (older ones are left over from earlier runs)."""
    found = {}
    for path in sorted((root / PROGRESS_DIR).glob("rank-*.failed")):
        try:
            if path.stat().st_mtime >= since:
                found[int(path.stem.split("-")[1])] = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
    return found


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> `{"a.b.c": leaf}`, for naming the settings that differ."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def settings_differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One `key: cache built with X, now Y` line per setting that differs."""
    old, new = flatten(before), flatten(now)
    missing = object()
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            shown_a = "(not set)" if a is missing else json.dumps(a)
            shown_b = "(not set)" if b is missing else json.dumps(b)
            lines.append(f"{key}: cache built with {shown_a}, now {shown_b}")
    return lines


def claim(root: Path, settings: Mapping[str, Any]) -> bool:
    """Record `settings` for a new cache, or check them against the ones it was started with.

    Returns True when resuming. Refuses a non-empty directory that is not one of our builds, and a
    build whose settings differ (naming every difference).
    """
    settings = json.loads(json.dumps(settings))  # tuples -> lists, so a round trip compares equal
    path = root / PROGRESS_DIR / SETTINGS_FILE
    if path.is_file():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        differences = settings_differences(recorded, settings)
        if differences:
            raise ValueError(
                f"{root}: this cache was started with different settings; use a new directory or the old settings:\n  "
                + "\n  ".join(differences)
            )
        return True
    if root.exists():
        foreign = sorted(p.name for p in root.iterdir() if p.name not in _OWN_ENTRIES)
        if foreign or (root / "metadata.json").exists():
            shown = foreign or ["metadata.json"]
            raise ValueError(
                f"{root}: not empty and not a build of this tool ({PROGRESS_DIR}/{SETTINGS_FILE} is missing; "
                f"found {shown[:5]}); choose an empty or new directory"
            )
    write_text_atomic(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return False
