"""Open the index of a cache at a URL: copy metadata.json and its index shards into a local mirror, then parse.

Payloads stay remote; only the JSON index is copied, into `<local_root>/<key>/index/` (the key
hashes the URL), so the usual parser and the stored compact index apply unchanged. A shard whose
bytes did not change is not rewritten, which keeps the stored index current across opens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .._atomic import write_bytes_atomic
from ..errors import fail, read_failed
from ..index.index import MANIFEST, MAX_MANIFEST_BYTES, CacheIndex, load_manifest
from ..index.store import open_index, user_cache_dir
from .remote import RemoteStore
from .secrets import redacted_url


def default_local_root() -> Path:
    """Where remote caches keep their index mirror and cached shards by default."""
    return user_cache_dir() / "remote"


def local_dir_for(store: RemoteStore, local_root: str | Path | None) -> Path:
    """This URL's own directory under `local_root` (one per cache, shared by every process on the node)."""
    root = (Path(local_root).expanduser() if local_root else default_local_root()).resolve()
    key = hashlib.sha256(store.url.encode()).hexdigest()[:16]
    return root / key


def refresh(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically unless it already holds exactly that."""
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    write_bytes_atomic(path, data)


def open_remote_index(store: RemoteStore, local_dir: Path, use_store: bool = True) -> CacheIndex:
    """The index of the cache at `store.url`, parsed from a local copy of its JSON files."""
    mirror = local_dir / "index"
    try:
        size = store.size(MANIFEST)
    except FileNotFoundError:
        shown = redacted_url(store.url)
        raise FileNotFoundError(f"{shown}: no {MANIFEST} here; is {shown} an image-edit cache?") from None
    if size > MAX_MANIFEST_BYTES:
        fail(store.url_of(MANIFEST), "file", f"is {size} bytes, more than the {MAX_MANIFEST_BYTES} bytes allowed")
    refresh(mirror / MANIFEST, store.read_all(MANIFEST))
    _, shards = load_manifest(mirror)  # names checked to stay inside the cache before anything is fetched
    for shard in shards:
        try:
            refresh(mirror / shard, store.read_all(shard))
        except FileNotFoundError as error:  # as for a local cache: a missing index shard is a content fault
            read_failed(redacted_url(store.url_of(shard)), error)
    return open_index(mirror, use_store=use_store)
