"""Damaged and old-format copies of a packed cache, made by editing its files directly (not through the package)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import xxhash

from image_edit_data.index.store import open_index


def copy_cache(packed: Path, out: Path) -> Path:
    """A copy of a packed cache's files, without its stored index."""
    shutil.copytree(packed, out, ignore=shutil.ignore_patterns(".image_edit_data", "progress"))
    return out


def flip_member_byte(root: Path, sample: int) -> tuple[str, str, str, str]:
    """Flip one byte near the end of sample `sample`'s member (tensor data: the payload still parses).

    Returns the shard path, the member name, the recorded checksum and the damaged bytes' checksum.
    """
    index = open_index(root, use_store=False)
    number, offset, length = index.member(sample)
    shard = index.shards[number].path
    data = bytearray((root / shard).read_bytes())
    data[offset + length - 10] ^= 0x01
    (root / shard).write_bytes(bytes(data))
    found = xxhash.xxh3_64_hexdigest(bytes(data[offset : offset + length]))
    return shard, index.relative_path(sample), f"{index.checksum(sample):016x}", found


def drop_checksums(read: Callable[[str], bytes], write: Callable[[str, bytes], object]) -> None:
    """Rewrite a packed cache's index files (read and written by name) as they were before member checksums.

    The shards' XXH3-128 (which came later) goes too: such a cache has only the SHA-256 of each shard.
    """
    manifest = json.loads(read("metadata.json"))
    manifest.pop("member_checksum", None)
    for shard in manifest["packed_shards"]:
        shard.pop("xxh3_128", None)
    write("metadata.json", json.dumps(manifest, indent=2).encode())
    for name in manifest["shards"]:
        records = json.loads(read(name))
        for record in records:
            record.pop("xxh3_64", None)
        write(name, json.dumps(records).encode())


def drop_local_checksums(root: Path) -> Path:
    """`drop_checksums` on a local cache directory."""
    drop_checksums(lambda name: (root / name).read_bytes(), lambda name, data: (root / name).write_bytes(data))
    return root


def sample_in_shard(root: Path, number: int, skip: int = 0) -> int:
    """A sample whose member lies in shard `number` (the `skip`-th such one)."""
    index = open_index(root, use_store=False)
    return [i for i in range(len(index)) if index.member(i)[0] == number][skip]
