"""Whole-shard checks of a packed cache for `cache validate`: size, hashes and each member's tar header.

Training never scans a shard; validation does, once: it hashes every shard (SHA-256, and XXH3-128
when the manifest has it: downloads check that one) and reads the tar header block in front of
each member, which must name the member and its length. A member name that is absolute or climbs
out with `..` is reported, so extracting a shard with `tar` stays safe.
Member checksums are checked when `cache validate` loads each sample through the reader, as in
training (storage/reader.py), so they are not hashed a second time here.
"""

from __future__ import annotations

import posixpath
import tarfile
from dataclasses import dataclass

from ...index.index import CacheIndex
from ...storage.reader import PayloadReader


@dataclass(frozen=True)
class ShardProblem:
    """One problem of one shard or member."""

    file: str
    field: str
    reason: str


def safe_member_name(name: str) -> bool:
    """A relative name that stays inside the extraction directory."""
    normal = posixpath.normpath(name)
    return bool(name) and not name.startswith("/") and normal != ".." and not normal.startswith("../")


def check_shards(reader: PayloadReader) -> list[ShardProblem]:
    """Every problem of the shards of a packed cache (empty when all match the manifest and index)."""
    index: CacheIndex = reader.index
    problems: list[ShardProblem] = []
    members: dict[int, list[int]] = {}
    for i in range(len(index)):
        members.setdefault(index.member(i)[0], []).append(i)
    for number, shard in enumerate(index.shards):
        where = reader.store.url_of(shard.path) if reader.store else shard.path
        try:
            data = reader.shard_bytes(number)
        except OSError as error:
            problems.append(ShardProblem(where, "file", f"cannot be read: {error}"))
            continue
        if len(data) != shard.nbytes:
            reason = f"shard is {len(data)} bytes, the manifest says {shard.nbytes}"
            problems.append(ShardProblem(where, "bytes", reason))
            continue
        for field, expected, digest in shard.whole_checks():
            digest.update(data)
            if digest.hexdigest() != expected:
                reason = f"shard hashes to {digest.hexdigest()}, the manifest says {expected}"
                problems.append(ShardProblem(where, field, reason))
        for i in members.get(number, []):
            problems.extend(check_member(index, i, data, where))
    return problems


def check_member(index: CacheIndex, i: int, data: bytes, where: str) -> list[ShardProblem]:
    """The tar header in front of sample `i`'s member must name it and its length."""
    _, offset, length = index.member(i)
    name = index.relative_path(i)
    display = f"{where}[{name}]"
    if not safe_member_name(name):
        return [ShardProblem(display, "cache_file", f"member name {name!r} would extract outside the directory")]
    if offset < tarfile.BLOCKSIZE or offset % tarfile.BLOCKSIZE:
        return [
            ShardProblem(display, "offset", f"{offset} is not a tar data offset (a multiple of 512, after a header)")
        ]
    try:
        header = tarfile.TarInfo.frombuf(data[offset - tarfile.BLOCKSIZE : offset], "utf-8", "strict")
    except tarfile.TarError as error:
        return [ShardProblem(display, "offset", f"no tar header in front of the member ({error})")]
    problems = []
    if header.size != length:
        problems.append(ShardProblem(display, "length", f"the tar header says {header.size} bytes, the index {length}"))
    # A name too long for the header block sits in a PAX record before it; the block holds a shortened one.
    if len(name.encode()) < 100 and header.name != name:
        problems.append(ShardProblem(display, "cache_file", f"the tar header names {header.name!r}"))
    return problems
