"""The zip layout `torch.save` writes: its entries and where their tensor data lies.

Read with a few `pread`s, since `zipfile` would cost as much as the rest of a payload's checks.
Anything other than the plain layout torch.save writes (a comment, zip64 sizes, several disks,
damage) gives None, and the caller falls back to `zipfile` or to torch itself.
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


def stored_data_ranges(descriptor: int, entries: list[ZipEntry], size: int) -> dict[bytes, tuple[int, int]] | None:
    """Where the tensor data entries (`<archive>/data/<key>`) lie in a torch.save file, by entry name.

    None when the tensors cannot be read straight from the file: a data entry is compressed or
    damaged, or they were saved in the other byte order (torch swaps those bytes as it loads them).
    Only these entries and `byteorder` are looked at: one local header read each.
    """
    ranges = {}
    for entry in entries:
        parts = entry.name.rsplit(b"/", 2)
        is_data, is_byteorder = len(parts) == 3 and parts[1] == b"data", parts[-1] == b"byteorder"
        if not (is_data or is_byteorder):
            continue
        found = data_range(descriptor, entry, size)
        if found is None:
            return None
        if is_byteorder:
            start, end = found
            if os.pread(descriptor, end - start, start).decode("ascii", "replace") != sys.byteorder:
                return None
        else:
            ranges[entry.name] = found
    return ranges
