"""Turn the journals of all ranks into the index: shards first, `metadata.json` last.

Records are ordered by row index (the source position unless a manifest line gives `metadata.row_index`),
so the index depends only on the source, never on which rank wrote what or in which order. The merging
rank waits until every position below the row limit is journaled, a rank reports failure, or the timeout
passes, woken by each change to the progress directory (`watch.py`), not by a clock.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._atomic import write_text_atomic
from ...index.index import MANIFEST
from .journal import PROGRESS_DIR, JournalReader, failures
from .watch import DirectoryWatch


@dataclass(frozen=True)
class MergeReport:
    """What the index holds."""

    shards: tuple[str, ...]
    samples: int
    skipped: int
    skipped_by_reason: Mapping[str, int] = field(default_factory=dict)


def shard_name(number: int) -> str:
    """File name of index shard `number`."""
    return f"metadata_shard_{number:04d}.json"


def wait_for_journals(
    root: Path,
    rows: int,
    *,
    since: float,
    timeout: float,
    poll_interval: float,
    log: Callable[[str], None],
) -> dict[int, dict[str, Any]]:
    """Every journal entry once positions 0..rows-1 are all present; raises on a rank failure or timeout.

    Each change to the progress directory wakes the wait; `poll_interval` is the longest it sleeps without
    a look (a network file system written from other machines signals no change).
    """
    with DirectoryWatch(root / PROGRESS_DIR) as watch:
        return _wait(root, rows, since, time.monotonic() + timeout, timeout, poll_interval, log, watch)


def _wait(
    root: Path,
    rows: int,
    since: float,
    deadline: float,
    timeout: float,
    poll_interval: float,
    log: Callable[[str], None],
    watch: DirectoryWatch,
) -> dict[int, dict[str, Any]]:
    reader = JournalReader(root)
    announced = False
    while True:
        entries = reader.refresh()
        missing = rows - sum(1 for p in entries if 0 <= p < rows)
        if missing == 0:
            return entries
        failed = failures(root, since)
        if failed:
            rank, message = next(iter(failed.items()))
            raise RuntimeError(
                f"{root}: rank {rank} stopped, so the index was not merged ({missing} samples not done): {message}"
            )
        if time.monotonic() >= deadline:
            older = "".join(f" Rank {r} earlier reported: {m}." for r, m in failures(root, 0.0).items())
            raise TimeoutError(
                f"{root}: gave up after waiting {timeout:g} s: {missing} of {rows} samples are not done yet. "
                f"Rerun the same command on the missing ranks, or on one process with --world-size 1, to finish.{older}"
            )
        if not announced:
            log(f"waiting for other ranks: {missing} of {rows} samples not done yet")
            announced = True
        watch.wait(min(poll_interval, deadline - time.monotonic()))


def merge_index(
    root: Path,
    entries: Mapping[int, Mapping[str, Any]],
    rows: int,
    shard_size: int,
    provenance: Mapping[str, Any],
) -> MergeReport:
    """Write the shards and then metadata.json (with `provenance`, counts and the skipped samples)."""
    # By row index, as NeMo Automodel orders its index.
    records = sorted(
        (entries[p]["record"] for p in range(rows) if "record" in entries[p]), key=lambda r: r["row_index"]
    )
    skipped = [{"row_index": p, **entries[p]["skipped"]} for p in range(rows) if "skipped" in entries[p]]
    names = []
    for number, start in enumerate(range(0, len(records), shard_size)):
        names.append(shard_name(number))
        lines = ",\n".join(json.dumps(record) for record in records[start : start + shard_size])
        write_text_atomic(root / names[-1], f"[\n{lines}\n]\n")  # one record per line: greppable, diffable
    reasons = Counter(s["kind"] for s in skipped)
    manifest = {
        "shards": names,
        **provenance,
        "counts": {
            "rows": rows,
            "samples": len(records),
            "skipped": len(skipped),
            "skipped_by_reason": dict(sorted(reasons.items())),
        },
        "skipped_samples": skipped,
    }
    # Written last: a cache without metadata.json is visibly unfinished.
    write_text_atomic(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return MergeReport(tuple(names), len(records), len(skipped), dict(reasons))
