"""Index open time and memory for `image-edit-data bench`, each open in a child process of its own.

Ours opens twice: first by parsing the shards (its stored index removed beforehand), which also
stores the compact index, then again from that store; another loader given to the bench opens once. A child
times one open and its RSS growth (the opened object kept alive), frees it, then opens again under
tracemalloc for the bytes the opened object holds and the peak while opening. Children are forked
from the bench before it loads anything, so every opener starts from the same small process.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import tracemalloc
from collections.abc import Callable, Sized
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dataset import ImageEditDataset
from ..index.store import candidate_paths, store_key
from .measure import Step, load_average, rss_bytes

if TYPE_CHECKING:
    from .other import OtherLoader

Opener = Callable[[str], Sized]


def stored_index_files(root: Path) -> list[Path]:
    """Where our stored index of the cache's current shards would be read from."""
    root = root.expanduser().resolve()  # the user-directory copy is named after the resolved path
    key = store_key(root)
    return [] if key is None else candidate_paths(root, key)


def forget_stored_index(root: Path) -> None:
    """Remove our stored index of the cache's current shards, so the next open parses them.

    Only those files go: `.image_edit_data/` may also hold a quarantine list worth keeping.
    """
    for path in stored_index_files(root):
        path.unlink(missing_ok=True)


def _open_ours(cache_dir: str) -> ImageEditDataset:
    """Our dataset, opened as a training run opens it (through the stored index when it is current)."""
    return ImageEditDataset(cache_dir)


def _open_in_child(opener: Opener, cache_dir: str, parse: bool) -> dict[str, Any]:
    """Time one open and trace another; run in a child process (see the module docstring)."""
    root = Path(cache_dir)
    if parse:
        forget_stored_index(root)
    stored = any(path.is_file() for path in stored_index_files(root))
    gc.collect()
    before = rss_bytes()
    start = time.perf_counter()
    opened = opener(cache_dir)
    seconds = time.perf_counter() - start
    after = rss_bytes()
    samples = len(opened)
    index = getattr(opened, "index", None)
    del opened
    gc.collect()
    if parse:
        forget_stored_index(root)
    tracemalloc.start()
    try:
        opened = opener(cache_dir)
        gc.collect()  # count what the opened object holds, not garbage waiting for the collector
        retained, peak = tracemalloc.get_traced_memory()
        del opened
    finally:
        tracemalloc.stop()
    return {
        "seconds": seconds,
        "samples": samples,
        "from_store": stored,
        "rss_growth_bytes": None if before is None or after is None else after - before,
        "traced_retained_bytes": retained,
        "traced_peak_bytes": peak,
        "retained_bytes_per_sample": retained / max(samples, 1),
        "index_array_bytes": None if index is None else int(index.nbytes),
    }


def _measure_in_child(opener: Opener, cache_dir: Path, parse: bool) -> dict[str, Any]:
    """`_open_in_child` in a forked process (in this one where there is no fork)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return _open_in_child(opener, str(cache_dir), parse)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_open_in_child, opener, str(cache_dir), parse).result()


def measure_index_opens(cache_dir: Path, other: OtherLoader | None, step: Step) -> list[dict[str, Any]]:
    """One row per open: ours parsing, ours from the store, and the other loader's (when given)."""
    openers: list[tuple[str, str, Opener, bool]] = [
        ("ours", "parse", _open_ours, True),
        ("ours", "stored", _open_ours, False),
    ]
    if other is not None:
        openers.append((other.name, "parse", other.open_index, False))
    rows: list[dict[str, Any]] = []
    for loader, how, opener, parse in openers:
        with step(f"opening the index: {loader}, {how}"):
            rows.append({"loader": loader, "open": how, "load_average_1m": load_average()})
            rows[-1].update(_measure_in_child(opener, cache_dir, parse))
    other_seconds: float | None = rows[-1]["seconds"] if other is not None else None
    for row in rows:
        row["seconds_over_other"] = None if other_seconds is None else row["seconds"] / other_seconds
    return rows
