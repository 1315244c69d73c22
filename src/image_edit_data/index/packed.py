"""The packed layout's index fields: a shard list in the manifest, `(shard, offset, length)` per record.

A packed cache stores its payloads as members of uncompressed tar shards (`cache pack` writes
them). The manifest lists every shard with its size, SHA-256 and XXH3-128 under `packed_shards`, and every
index record names where its member's bytes lie, so a reader seeks straight to a sample and
never scans a tar header or lists a directory:

```
metadata.json   {"layout": "packed-tar", "packed_shards": [{"path", "bytes", "sha256", "xxh3_128"}, ...],
                 "member_checksum": "xxh3_64", "shards": [...]}
index record    {"cache_file": "<member name>", "shard": 3, "offset": 1536, "length": 40960,
                 "xxh3_64": "<16 hex digits>", ...}
```
Offsets and lengths are JSON integers, kept as int64 (shards beyond 4 GiB are fine). The member
checksum is XXH3-64 of the member's bytes, written as hex (JSON numbers lose digits past 2**53)
and kept as uint64; a reader hashes the bytes it already has for a sample and compares. Caches
packed before checksums have no `member_checksum` key and no `xxh3_64` fields: they read as
before, with nothing to compare. A shard's XXH3-128 is what a download into the node's shard cache
is checked against (18x faster than SHA-256 over the same bytes); caches packed before it have only
the SHA-256, which downloads then check instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..contract.paths import contained
from ..errors import fail, show

LAYOUT = "packed-tar"
LAYOUT_KEY = "layout"
SHARDS_KEY = "packed_shards"
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_OFFSET = 2**63 - 1
MANIFEST = "metadata.json"
CHECKSUM_KEY = "member_checksum"  # manifest: the algorithm of the records' member checksums
CHECKSUM = "xxh3_64"  # the one algorithm, and the record field holding a member's checksum
CHECKSUM_HEX = re.compile(r"[0-9a-f]{16}")
SHARD_CHECKSUM = "xxh3_128"  # the shard entry field holding the whole shard's XXH3-128
SHARD_CHECKSUM_HEX = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard of a packed cache: path relative to the cache root, size in bytes, SHA-256 and XXH3-128 (hex).

    `xxh3_128` is None for a shard packed before the manifest recorded it.
    """

    path: str
    nbytes: int
    sha256: str
    xxh3_128: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest entry."""
        entry: dict[str, Any] = {"path": self.path, "bytes": self.nbytes, "sha256": self.sha256}
        if self.xxh3_128 is not None:
            entry[SHARD_CHECKSUM] = self.xxh3_128
        return entry

    def whole_checks(self) -> list[tuple[str, str, Any]]:
        """Every hash the manifest gives for the whole shard, fastest last: (field, expected hex, a fresh hasher).

        A download checks the last (XXH3-128 costs it 1 ms per 32 MiB against SHA-256's 19); `cache
        validate` checks them all.
        """
        checks: list[tuple[str, str, Any]] = [("sha256", self.sha256, hashlib.sha256())]
        if self.xxh3_128 is not None:
            checks.append((SHARD_CHECKSUM, self.xxh3_128, xxhash.xxh3_128()))
        return checks


def is_packed(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest describes a packed cache."""
    return manifest.get(LAYOUT_KEY) == LAYOUT


def has_checksums(manifest: Mapping[str, Any]) -> bool:
    """Whether a packed manifest declares member checksums (refusing an algorithm we do not know)."""
    algorithm = manifest.get(CHECKSUM_KEY)
    if algorithm is None:
        return False
    if algorithm != CHECKSUM:
        fail(
            MANIFEST,
            CHECKSUM_KEY,
            f"expected {CHECKSUM!r} (or no key: a cache packed before checksums), got {show(algorithm)}",
        )
    return True


def member_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum of a member's bytes (XXH3-64)."""
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_text(value: int) -> str:
    """A checksum as the index writes it: 16 lowercase hex digits."""
    return f"{value:016x}"


def check_member_bytes(data: bytes | bytearray | memoryview, expected: int, display: str, source: str) -> None:
    """Refuse a member whose bytes do not hash to its recorded checksum, naming both checksums."""
    found = member_checksum(data)
    if found != expected:
        fail(
            display,
            CHECKSUM,
            f"member bytes hash to {checksum_text(found)}, the index says {checksum_text(expected)} "
            f"({source}; the shard is damaged or was replaced)",
        )


def shard_list(root: Path, manifest: Mapping[str, Any]) -> tuple[ShardInfo, ...]:
    """The checked `packed_shards` of a packed manifest (paths inside the cache, sizes, hashes)."""
    entries = manifest.get(SHARDS_KEY)
    if not isinstance(entries, list):
        fail(MANIFEST, SHARDS_KEY, f"expected a list of shard entries in a {LAYOUT} cache, got {show(entries)}")
    shards: list[ShardInfo] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{SHARDS_KEY}[{i}]"
        if not isinstance(entry, dict):
            fail(MANIFEST, where, f"expected an object with path, bytes and sha256, got {show(entry)}")
        path = contained(root, entry.get("path"), MANIFEST, f"{where}.path")
        if path in seen:
            fail(MANIFEST, f"{where}.path", f"{path!r} is listed twice")
        seen.add(path)
        size = entry.get("bytes")
        if type(size) is not int or not 0 < size <= MAX_OFFSET:
            fail(MANIFEST, f"{where}.bytes", f"expected a positive integer, got {show(size)}")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            fail(MANIFEST, f"{where}.sha256", f"expected 64 lowercase hex digits, got {show(digest)}")
        fast = entry.get(SHARD_CHECKSUM)
        if fast is not None and (not isinstance(fast, str) or not SHARD_CHECKSUM_HEX.fullmatch(fast)):
            fail(MANIFEST, f"{where}.{SHARD_CHECKSUM}", f"expected 32 lowercase hex digits, got {show(fast)}")
        shards.append(ShardInfo(path, size, digest, fast))
    return tuple(shards)


class PackedFields:
    """Per-record `(shard, offset, length)` of a packed cache, checked as the index records are read."""

    def __init__(self, shards: tuple[ShardInfo, ...], checksums: bool = False) -> None:
        self.shards = shards
        self.shard_ids: list[int] = []
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.checksums: list[int] | None = [] if checksums else None

    def add(self, record: Mapping[str, Any], file: str, where: str) -> None:
        """Check and keep one record's location (every member must lie inside its shard) and checksum."""
        shard, offset, length = record.get("shard"), record.get("offset"), record.get("length")
        if type(shard) is not int or not 0 <= shard < len(self.shards):
            fail(file, f"{where}.shard", f"expected a shard number in [0, {len(self.shards)}), got {show(shard)}")
        if type(offset) is not int or offset < 0:
            fail(file, f"{where}.offset", f"expected a non-negative integer, got {show(offset)}")
        if type(length) is not int or length <= 0:
            fail(file, f"{where}.length", f"expected a positive integer, got {show(length)}")
        size = self.shards[shard].nbytes
        if offset + length > size:
            fail(
                file,
                f"{where}.length",
                f"member bytes [{offset}, {offset + length}) end beyond shard {self.shards[shard].path} "
                f"of {size} bytes",
            )
        if self.checksums is not None:
            value = record.get(CHECKSUM)
            if type(value) is not str or not CHECKSUM_HEX.fullmatch(value):
                fail(file, f"{where}.{CHECKSUM}", f"expected 16 lowercase hex digits, got {show(value)}")
            self.checksums.append(int(value, 16))
        self.shard_ids.append(shard)
        self.offsets.append(offset)
        self.lengths.append(length)

    def arrays(self) -> dict[str, np.ndarray]:
        """The locations as the index's arrays."""
        return {
            "member_shard": np.asarray(self.shard_ids, dtype=np.int32),
            "member_offset": np.asarray(self.offsets, dtype=np.int64),
            "member_length": np.asarray(self.lengths, dtype=np.int64),
        }

    def checksum_array(self) -> np.ndarray | None:
        """[N] uint64 member checksums, or None for a cache packed without them."""
        return None if self.checksums is None else np.asarray(self.checksums, dtype=np.uint64)


def shards_fingerprint(shards: tuple[ShardInfo, ...]) -> bytes:
    """The shard list as bytes for the index fingerprint: a repacked cache never resumes as the old one.

    Path, size and SHA-256 identify a shard; the XXH3-128 (added to manifests later) is left out, so
    a cache repacked only to gain it keeps the fingerprint of the same bytes.
    """
    return json.dumps([{"path": s.path, "bytes": s.nbytes, "sha256": s.sha256} for s in shards]).encode()


def shards_from_json(entries: list[dict[str, Any]]) -> tuple[ShardInfo, ...]:
    """Shard entries stored by the index store (already checked when first parsed)."""
    return tuple(ShardInfo(str(e["path"]), int(e["bytes"]), str(e["sha256"]), e.get(SHARD_CHECKSUM)) for e in entries)
