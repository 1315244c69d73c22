"""A packed member's recorded checksum, checked on the bytes the batch receives and re-read once before it counts.

A member's XXH3-64 is computed in the same pass that copies its tensors into the batch: the
header (already read to parse the member) and any bytes the batch does not take are hashed from
where they are, the tensors from their places in the batch, all in file order (`digest`). A
mismatch is not final: the whole member is read afresh (`reread`); bytes that then match replace
what the batch received, and only a second mismatch counts as damage (`confirmed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import xxhash

from .._retry import with_read_retries
from ..errors import CacheFormatError
from ..index.packed import CHECKSUM, checksum_text, member_checksum

Buffer = bytes | bytearray | memoryview
EMPTY = memoryview(b"")


class MemberCheck:
    """What reading one member still has to check; `base` is where the member starts in its file (or bytes)."""

    __slots__ = ("base", "display", "expected", "length", "source")

    def __init__(self, expected: int, display: str, source: str, base: int, length: int) -> None:
        self.expected = expected
        self.display = display  # names shard and member: `shards/b0000-000001.tar[samples/x.safetensors]`
        self.source = source  # where the bytes came from, for the error
        self.base = base
        self.length = length

    def digest(self, placed: Sequence[tuple[int, memoryview]]) -> int:
        """XXH3-64 of the member, given some of its byte ranges as copied into the batch: (offset, their bytes).

        Offsets are in the member's file (or fetched bytes); every byte no range covers is taken from `span`.
        """
        hasher = xxhash.xxh3_64()  # streaming updates run without the GIL, so two reader threads hash at once
        update = hasher.update
        cursor, end = self.base, self.base + self.length
        for offset, view in sorted(placed, key=_offset):
            if offset != cursor:
                if offset > cursor:
                    update(self.span(cursor, offset))
                    cursor = offset
                else:  # overlapping ranges: hash each byte once
                    view = view[cursor - offset :]
            update(view)
            cursor += len(view)
        if cursor < end:
            update(self.span(cursor, end))
        return int(hasher.intdigest())

    def span(self, start: int, end: int) -> Buffer:
        """Member bytes `[start, end)` (offsets in its file or fetched bytes) that the batch does not hold."""
        raise NotImplementedError

    def held(self, offset: int, nbytes: int) -> memoryview:
        """The first bytes of `[offset, offset + nbytes)` that this check already holds in memory (maybe none)."""
        return EMPTY

    def reread(self) -> Buffer:
        """The whole member, read afresh."""
        raise NotImplementedError

    def whole(self) -> Buffer:
        """The whole member to check first: read now from a file; fetched bytes as they came."""
        return self.reread()

    def confirmed(self) -> Buffer | CacheFormatError:
        """The member read afresh when its bytes now match, else the error that names the damage."""
        fresh = self.reread()
        found = member_checksum(fresh)
        return fresh if found == self.expected else self.mismatch(found)

    def verified_bytes(self) -> Buffer:
        """The whole member, checked (read again once on a mismatch); raises the error when the damage is confirmed."""
        first = self.whole()
        if member_checksum(first) == self.expected:
            return first
        result = self.confirmed()
        if isinstance(result, CacheFormatError):
            raise result
        return result

    def mismatch(self, found: int) -> CacheFormatError:
        """The error for a member whose bytes hash to `found` twice, naming shard, member and both checksums."""
        return CacheFormatError(
            self.display,
            CHECKSUM,
            f"member bytes hash to {checksum_text(found)}, the index says {checksum_text(self.expected)} "
            f"({self.source}, read again to confirm; the shard is damaged or was replaced)",
        )


def _offset(part: tuple[int, memoryview]) -> int:
    return part[0]


class FileMember(MemberCheck):
    """A member of an open shard: `head` holds its first bytes, as read to parse its header."""

    __slots__ = ("descriptor", "head", "head_end")

    def __init__(
        self, expected: int, display: str, source: str, descriptor: int, base: int, length: int, head: bytes
    ) -> None:
        self.expected, self.display, self.source, self.base, self.length = expected, display, source, base, length
        self.descriptor = descriptor
        self.head = memoryview(head)
        self.head_end = base + len(head)

    def held(self, offset: int, nbytes: int) -> memoryview:
        if offset >= self.head_end or offset < self.base:  # most tensors: past what the header's read brought
            return EMPTY
        start = offset - self.base
        return self.head[start : start + nbytes]

    def span(self, start: int, end: int) -> Buffer:
        if end <= self.head_end:
            return self.head[start - self.base : end - self.base]
        if start < self.head_end:
            return self.head[start - self.base :].tobytes() + pread_all(
                self.descriptor, end - self.head_end, self.head_end, self.display
            )
        return pread_all(self.descriptor, end - start, start, self.display)

    def reread(self) -> Buffer:
        return pread_all(self.descriptor, self.length, self.base, self.display)


class FetchedMember(MemberCheck):
    """A member fetched into memory; `refetch` fetches it again (without one, its bytes are hashed again)."""

    __slots__ = ("data", "refetch")

    def __init__(
        self, expected: int, display: str, source: str, data: memoryview, refetch: Callable[[], Buffer] | None
    ) -> None:
        super().__init__(expected, display, source, 0, len(data))
        self.data = data
        self.refetch = refetch

    def span(self, start: int, end: int) -> Buffer:
        return self.data[start:end]

    def reread(self) -> Buffer:
        return self.data if self.refetch is None else self.refetch()

    def whole(self) -> Buffer:
        return self.data


def pread_all(descriptor: int, length: int, offset: int, display: str = "a cache file") -> bytes:
    """`length` bytes at `offset`, fewer only where the file ends (a shard truncated since it was opened)."""
    return with_read_retries(lambda: pread_whole(descriptor, length, offset), display)


def pread_whole(descriptor: int, length: int, offset: int) -> bytes:
    """`pread_all`'s one try."""
    data = os.pread(descriptor, length, offset)
    if len(data) == length:
        return data
    parts = [data]
    done = len(data)
    while done < length:
        more = os.pread(descriptor, length - done, offset + done)
        if not more:
            break
        parts.append(more)
        done += len(more)
    return b"".join(parts)
