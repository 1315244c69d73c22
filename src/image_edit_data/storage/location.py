"""Where a cache lives, parsed once where it is opened: a local directory, or a URL with its remote options.

`CacheLocation.of(cache_dir, ...)` decides, once, whether a cache is local (a path or a `file://`
URL) and checks the remote options; `location.open()` returns its index and the one reader for its
layout: local files, local tar shards, remote files or remote tar shards (`reader.py`,
`remote_reader.py`). Everything else asks the location rather than looking at the string again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from ..index.index import CacheIndex
from ..index.store import open_index
from .damaged import DamagedShards
from .mirror import local_dir_for, open_remote_index
from .reader import LocalFilesReader, LocalPackedReader, PayloadReader
from .remote import RemoteStore, RequestPolicy, is_url
from .remote_reader import RemoteFilesReader, RemotePackedReader
from .secrets import without_redacted
from .shard_cache import ShardCache

RemoteRead = Literal["range", "shard_cache"]
REMOTE_READS = ("range", "shard_cache")
DEFAULT_SHARD_CACHE_BYTES = 8 << 30


@dataclass(frozen=True)
class CacheLocation:
    """A cache's place and how to reach it; the remote options matter only for a URL."""

    given: str
    """The location as the user wrote it (a path or a URL), for messages."""
    local_path: Path | None
    """The cache directory on this machine, or None for a remote URL."""
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)  # credentials: never shown
    """fsspec options for a URL (endpoint, credentials; values a redaction left are dropped: `secrets.py`)."""
    remote_read: RemoteRead = "range"
    """Remote packed caches: one ranged request per sample, or a node-local shard cache."""
    local_cache_dir: str | None = None
    """Node-local directory for remote index copies and cached shards (default: the user cache directory)."""
    shard_cache_bytes: int = DEFAULT_SHARD_CACHE_BYTES
    """Byte budget of the shard cache."""
    latency: float = 0.0
    """Seconds added before every remote request (benchmarks of slow links)."""
    requests: RequestPolicy = field(default_factory=RequestPolicy)
    """Deadlines and the retry budget of each remote request."""

    @classmethod
    def of(
        cls,
        cache_dir: str | os.PathLike[str] | CacheLocation,
        *,
        storage_options: Mapping[str, Any] | None = None,
        remote_read: RemoteRead = "range",
        local_cache_dir: str | None = None,
        shard_cache_bytes: int = DEFAULT_SHARD_CACHE_BYTES,
        latency: float = 0.0,
        remote_requests: RequestPolicy | Mapping[str, Any] | None = None,
    ) -> CacheLocation:
        """Parse a location (a `CacheLocation` is returned as it is) and check its options."""
        if isinstance(cache_dir, CacheLocation):
            return cache_dir
        if remote_read not in REMOTE_READS:
            raise ValueError(f"remote_read must be one of {REMOTE_READS}, got {remote_read!r}")
        if isinstance(shard_cache_bytes, bool) or not isinstance(shard_cache_bytes, int) or shard_cache_bytes <= 0:
            raise ValueError(f"shard_cache_bytes must be a positive integer, got {shard_cache_bytes!r}")
        given = os.fspath(cache_dir)
        local = local_path_of(given)
        return cls(
            given,
            Path(local) if local is not None else None,
            without_redacted(storage_options or {}),
            remote_read,
            local_cache_dir,
            shard_cache_bytes,
            latency,
            RequestPolicy.of(remote_requests),
        )

    @property
    def is_local(self) -> bool:
        """Whether the cache is a directory on this machine."""
        return self.local_path is not None

    @property
    def display(self) -> Path | str:
        """A plain path as a `Path`; a URL (`file://` ones included) as the string given."""
        return Path(self.given) if self.local_path is not None and not is_url(self.given) else self.given

    def quarantine_default(self) -> Path | None:
        """Where skipped samples are listed by default: inside a local cache; nowhere for a remote one."""
        return None if self.local_path is None else self.local_path / ".image_edit_data" / "quarantine.jsonl"

    def open(self, use_store: bool = True) -> tuple[CacheIndex, PayloadReader]:
        """The cache's index and the reader for its layout."""
        if self.local_path is not None:
            index = open_index(self.local_path, use_store=use_store)
            return index, (LocalPackedReader(index) if index.packed else LocalFilesReader(index))
        store = RemoteStore(self.given, dict(self.storage_options), self.requests, self.latency)
        directory = local_dir_for(store, self.local_cache_dir)
        index = open_remote_index(store, directory, use_store=use_store)
        if not index.packed:
            return index, RemoteFilesReader(index, store)
        cache = None
        if self.remote_read == "shard_cache":
            cache = ShardCache(store, index.shards, directory / "shards", self.shard_cache_bytes)
        # Both read modes see the shard cache directory's verdicts: a shard damaged for one process is for all.
        return index, RemotePackedReader(index, store, cache, DamagedShards(directory / "shards"))


def local_path_of(location: str | os.PathLike[str]) -> str | None:
    """The local path a location names (`file://` URLs included), or None for a remote URL."""
    text = os.fspath(location)
    if not is_url(text):
        return text
    parsed = urlparse(text)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return unquote(parsed.path)
    return None
