"""Open a cache from a local directory or a URL, in either layout: its index and, when needed, a reader."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from ..index.index import CacheIndex
from ..index.store import open_index
from .damaged import DamagedShards
from .mirror import local_dir_for, open_remote_index
from .reader import PayloadReader
from .remote import RemoteStore, is_url
from .shard_cache import ShardCache

RemoteRead = Literal["range", "shard_cache"]
REMOTE_READS = ("range", "shard_cache")
DEFAULT_SHARD_CACHE_BYTES = 8 << 30


def local_path_of(location: str | os.PathLike[str]) -> str | None:
    """The local path a location names (`file://` URLs included), or None for a remote URL."""
    text = os.fspath(location)
    if not is_url(text):
        return text
    parsed = urlparse(text)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return unquote(parsed.path)
    return None


def open_location(
    cache_dir: str | os.PathLike[str],
    *,
    use_store: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    remote_read: RemoteRead = "range",
    local_cache_dir: str | None = None,
    shard_cache_bytes: int = DEFAULT_SHARD_CACHE_BYTES,
    latency: float = 0.0,
) -> tuple[CacheIndex, PayloadReader | None]:
    """The cache's index and the reader for its payloads (None: local one-file payloads, read by the dataset)."""
    if remote_read not in REMOTE_READS:
        raise ValueError(f"remote_read must be one of {REMOTE_READS}, got {remote_read!r}")
    local = local_path_of(cache_dir)
    if local is not None:
        index = open_index(local, use_store=use_store)
        return index, PayloadReader(index) if index.packed else None
    store = RemoteStore(os.fspath(cache_dir), dict(storage_options or {}), latency=latency)
    directory = local_dir_for(store, local_cache_dir)
    index = open_remote_index(store, directory, use_store=use_store)
    cache = None
    if remote_read == "shard_cache" and index.packed:
        cache = ShardCache(store, index.shards, directory / "shards", shard_cache_bytes)
    # Both read modes see the shard cache directory's verdicts: a shard damaged for one process is for all.
    return index, PayloadReader(index, store, cache, DamagedShards(directory / "shards"))


def quarantine_default(cache_dir: str | os.PathLike[str]) -> Path | None:
    """Where skipped samples are listed by default: inside a local cache; nowhere for a remote one."""
    local = local_path_of(cache_dir)
    return None if local is None else Path(local) / ".image_edit_data" / "quarantine.jsonl"
