"""The zip layout `torch.save` writes: its entries, the bytes they unpack to, and where their data lies.

Read with a few `pread`s and no objects per entry, so a payload's checks cost little next to
reading it. Anything other than the plain layout torch.save writes (a comment, zip64 sizes,
several disks, damage) gives None, and the caller falls back to `zipfile` or to torch itself.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import NamedTuple

END_RECORD = struct.Struct("<4s4H2LH")  # end of central directory: signature ... comment length
CENTRAL_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # local file header (30 bytes), before each entry's data
ZIP64_MARK = 0xFFFFFFFF
STORED = 0  # compression method: bytes kept as they are


class ZipEntry(NamedTuple):
    """One entry of the central directory."""

    name: bytes
    method: int
    packed_size: int
    unpacked_size: int
    header_offset: int  # where its local header starts


def zip_entries(descriptor: int, size: int) -> list[ZipEntry] | None:
    """The central directory of a zip as torch.save writes it, or None for any other layout."""
    if size < END_RECORD.size:
        return None
    end = END_RECORD.unpack(os.pread(descriptor, END_RECORD.size, size - END_RECORD.size))
    signature, disk, directory_disk, disk_entries, count, directory_size, directory_offset, comment = end
    if signature != b"PK\x05\x06" or disk or directory_disk or comment or disk_entries != count:
        return None
    if ZIP64_MARK in (directory_size, directory_offset) or directory_offset + directory_size > size:
        return None
    directory = os.pread(descriptor, directory_size, directory_offset)
    entries, position = [], 0
    for _ in range(count):
        if position + CENTRAL_ENTRY.size > len(directory):
            return None
        fields = CENTRAL_ENTRY.unpack_from(directory, position)
        if fields[0] != b"PK\x01\x02" or ZIP64_MARK in (fields[8], fields[9], fields[16]):
            return None
        start = position + CENTRAL_ENTRY.size
        name_length, extra_length, comment_length = fields[10], fields[11], fields[12]
        entries.append(ZipEntry(directory[start : start + name_length], fields[4], fields[8], fields[9], fields[16]))
        position = start + name_length + extra_length + comment_length
    return entries if position == len(directory) else None


def central_directory_total(descriptor: int, size: int) -> int | None:
    """Unpacked bytes of all entries (None: not the plain layout torch.save writes)."""
    entries = zip_entries(descriptor, size)
    return None if entries is None else sum(entry.unpacked_size for entry in entries)


def data_range(descriptor: int, entry: ZipEntry, size: int) -> tuple[int, int] | None:
    """The file bytes `[start, end)` of a stored entry's data, or None if it is compressed or damaged."""
    if entry.method != STORED or entry.packed_size != entry.unpacked_size:
        return None
    header = os.pread(descriptor, LOCAL_HEADER.size, entry.header_offset)
    if len(header) < LOCAL_HEADER.size:
        return None
    fields = LOCAL_HEADER.unpack(header)
    if fields[0] != b"PK\x03\x04":
        return None
    start = entry.header_offset + LOCAL_HEADER.size + fields[9] + fields[10]
    end = start + entry.packed_size
    return (start, end) if end <= size else None


def stored_data_ranges(descriptor: int, entries: list[ZipEntry], size: int) -> list[tuple[int, int]] | None:
    """Where every entry's bytes lie in a torch.save file whose tensors can be read straight from it.

    None when they cannot: another zip layout, a compressed entry, or tensors saved in the other
    byte order (torch swaps those bytes as it loads them).
    """
    ranges = []
    for entry in entries:
        found = data_range(descriptor, entry, size)
        if found is None:
            return None
        if entry.name.rsplit(b"/", 1)[-1] == b"byteorder":
            start, end = found
            if os.pread(descriptor, end - start, start).decode("ascii", "replace") != sys.byteorder:
                return None
        ranges.append(found)
    return ranges
