"""Keep a parsed cache index on disk so reopening a large cache reads one file, not every shard.

The compact index is stored beside the cache in `.image_edit_data/index-<key>.npz`, or in the
user cache directory when the cache is read-only. `<key>` hashes the manifest's bytes and each
shard's path, size and modification time, so editing a shard makes a fresh parse happen. A stored
index is only a speed-up: containment is still enforced when each payload is opened.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np

from .._atomic import write_bytes_atomic
from ..contract.signature import Signature
from .index import MANIFEST, CacheIndex, load_index, load_manifest
from .packed import has_checksums, shards_from_json

log = logging.getLogger(__name__)
STORE_VERSION = 1
STORE_DIR = ".image_edit_data"
ARRAYS = ("bucket_ids", "path_blob", "path_offsets", "text_tokens")
PACKED_ARRAYS = ("member_shard", "member_offset", "member_length")  # packed caches only
CHECKSUMS = "member_checksum"  # packed caches with member checksums only


def user_cache_dir() -> Path:
    """Where stored indexes of read-only caches go (`$XDG_CACHE_HOME/image_edit_data`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "image_edit_data"


def store_key(root: Path) -> str | None:
    """Hash of what the index is parsed from: the manifest and every shard's path, size and mtime.

    None when a shard is missing: then the parse reports it properly.
    """
    root = Path(root).expanduser().resolve()  # containment checks compare resolved paths
    manifest, shards = load_manifest(root)  # checks containment and size before anything is hashed
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
    for shard in shards:
        try:
            stat = (root / shard).stat()
        except FileNotFoundError:
            return None
        digest.update(f"{shard}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    digest.update(f"v{STORE_VERSION}".encode())
    return digest.hexdigest()[:24]


def candidate_paths(root: Path, key: str) -> list[Path]:
    """Beside the cache first, then the user cache directory (named after the cache's path)."""
    name = f"index-{key}.npz"
    user = user_cache_dir() / hashlib.sha256(str(root).encode()).hexdigest()[:16] / name
    return [root / STORE_DIR / name, user]


def open_index(cache_dir: str | Path, use_store: bool = True) -> CacheIndex:
    """Open a cache's index, from the stored compact form when it is current, else by parsing (then storing)."""
    root = Path(cache_dir).expanduser().resolve()
    if not use_store or not (root / MANIFEST).is_file():
        return load_index(root)
    key = store_key(root)
    if key is None:
        return load_index(root)
    paths = candidate_paths(root, key)
    for path in paths:
        if path.is_file():
            stored = _read_stored(path, root)
            if stored is not None:
                return stored
    index = load_index(root)
    for path in paths:
        try:
            write_bytes_atomic(path, serialize(index))
            return index
        except OSError:
            continue  # read-only cache: try the user cache directory
    log.info("could not store the parsed index of %s anywhere; it will be parsed again next time", root)
    return index


def serialize(index: CacheIndex) -> bytes:
    """The index as an uncompressed npz (no pickled objects)."""
    header = {
        "version": STORE_VERSION,
        "manifest": index.manifest,
        "signatures": [s.to_json() for s in index.signatures],
        "fingerprint": index.fingerprint,
        "shards": [s.to_json() for s in index.shards],
    }
    buffer = io.BytesIO()
    header_array = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    names = (
        ARRAYS + (PACKED_ARRAYS if index.packed else ()) + ((CHECKSUMS,) if index.member_checksum is not None else ())
    )
    np.savez(buffer, header=header_array, **{name: getattr(index, name) for name in names})
    return buffer.getvalue()


def _check_consistent(arrays: dict[str, np.ndarray], num_buckets: int) -> None:
    """Refuse stored arrays that do not describe one valid index (a damaged or planted file)."""
    ids, offsets, blob = arrays["bucket_ids"], arrays["path_offsets"], arrays["path_blob"]
    n = ids.shape[0]
    if ids.ndim != 1 or offsets.shape != (n + 1,) or arrays["text_tokens"].shape != (n,) or blob.ndim != 1:
        raise ValueError("array shapes disagree")
    if n and (ids.min() < 0 or ids.max() >= num_buckets):
        raise ValueError("bucket ids out of range")
    if offsets[0] != 0 or offsets[-1] != blob.shape[0] or np.any(np.diff(offsets) <= 0):
        raise ValueError("path offsets are not increasing within the path blob")
    if "member_shard" in arrays and not all(arrays[name].shape == (n,) for name in PACKED_ARRAYS):
        raise ValueError("packed member arrays disagree with the sample count")
    if CHECKSUMS in arrays and (arrays[CHECKSUMS].shape != (n,) or arrays[CHECKSUMS].dtype != np.uint64):
        raise ValueError("member checksums disagree with the sample count")


def _read_stored(path: Path, root: Path) -> CacheIndex | None:
    """Load a stored index, or None (and a log line) when it is unreadable or from another version."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            header = json.loads(stored["header"].tobytes())
            if header.get("version") != STORE_VERSION:
                return None
            arrays = {name: stored[name] for name in ARRAYS}
            if header.get("shards"):
                arrays.update({name: stored[name] for name in PACKED_ARRAYS})
                if has_checksums(header["manifest"]):  # a manifest that declares them must find them here
                    arrays[CHECKSUMS] = stored[CHECKSUMS]
        signatures = tuple(Signature.from_json(s) for s in header["signatures"])
        _check_consistent(arrays, len(signatures))
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as error:
        log.warning("ignoring unreadable stored index %s (%s); parsing the shards again", path, error)
        return None
    return CacheIndex(
        root=root,
        manifest=header["manifest"],
        signatures=signatures,
        fingerprint=header["fingerprint"],
        shards=shards_from_json(header.get("shards") or []),
        **arrays,  # type: ignore[arg-type]
    )
