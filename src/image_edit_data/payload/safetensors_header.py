"""Read a safetensors header into `FileTensor`s: tensor bytes stay where they are until the batch reads them.

The header is checked before anything is read: known dtypes only, every tensor's byte range inside
the data section and exactly `prod(shape) * itemsize` long. A header that declares a gigantic
shape therefore fails on arithmetic, never on an allocation.
"""

from __future__ import annotations

import json
import math
import os
from typing import NoReturn

import torch

from ..contract.file_tensor import FileTensor
from ..errors import fail

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ITEM_SIZES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
FIRST_READ = 16 * 1024  # one read holds the length and the whole header of a typical payload


def unreadable(display: str, reason: str) -> NoReturn:
    """The one error for a damaged or hostile safetensors file."""
    fail(display, "payload", f"not a readable safetensors file ({reason})")


def read_header(
    descriptor: int, size: int, display: str, base: int = 0
) -> tuple[dict[str, FileTensor], dict[str, str], bytes]:
    """A safetensors file's tensors (checked `FileTensor`s of `descriptor`), string metadata and the bytes read.

    `base` is where the safetensors bytes start in the file (a member of a packed tar shard) and
    `size` their length; every tensor must lie inside that range. The bytes read are the first of
    the member (the header, and whatever else the first read brought), which a member checksum hashes.
    """
    if size < 8:
        unreadable(display, f"{size} bytes, shorter than the 8-byte header length")
    head = os.pread(descriptor, min(FIRST_READ, size), base)
    header_length = checked_length(head, size, display)
    if 8 + header_length > len(head):
        head = os.pread(descriptor, 8 + header_length, base)
        if len(head) < 8 + header_length:
            unreadable(display, "the file ended inside the header")
    tensors, metadata = parse_header(head, header_length, size, display, descriptor, base)
    return tensors, metadata, head


def header_from_bytes(data: memoryview, display: str) -> tuple[dict[str, FileTensor], dict[str, str]]:
    """The tensors (as checked `FileTensor`s over `data`) and the string metadata of safetensors bytes in memory."""
    size = len(data)
    if size < 8:
        unreadable(display, f"{size} bytes, shorter than the 8-byte header length")
    header_length = checked_length(data[:8], size, display)
    return parse_header(data[: 8 + header_length], header_length, size, display, -1, 0, data)


def checked_length(head: bytes | memoryview, size: int, display: str) -> int:
    """The header length the first 8 bytes declare, refused when the file cannot hold it."""
    header_length = int.from_bytes(head[:8], "little")
    if header_length > min(MAX_HEADER, size - 8):
        unreadable(display, f"header length {header_length} exceeds the {size}-byte file")
    return header_length


def parse_header(
    head: bytes | memoryview,
    header_length: int,
    size: int,
    display: str,
    descriptor: int,
    base: int,
    memory: memoryview | None = None,
) -> tuple[dict[str, FileTensor], dict[str, str]]:
    """Check the JSON header in `head` and make a `FileTensor` per entry (of `descriptor`, or of `memory`)."""
    try:
        header = json.loads(bytes(head[8 : 8 + header_length]))
    except (UnicodeDecodeError, RecursionError, ValueError) as error:
        unreadable(display, f"header is not JSON: {str(error)[:200]}")
    if not isinstance(header, dict):
        unreadable(display, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        unreadable(display, "__metadata__ must map names to strings")
    data_start = base + 8 + header_length
    data_size = size - 8 - header_length
    tensors = {
        name: _entry_tensor(descriptor, data_start, data_size, name, entry, display, memory)
        for name, entry in header.items()
    }
    return tensors, metadata


def _entry_tensor(
    descriptor: int, start: int, data_size: int, name: str, entry: object, display: str, memory: memoryview | None
) -> FileTensor:
    """One checked header entry as a `FileTensor` (plain loops: this runs per tensor, per sample)."""
    if type(entry) is not dict:  # json.loads makes plain dicts
        unreadable(display, f"entry {name!r} is not an object")
    dtype_name = entry.get("dtype")
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        unreadable(display, f"tensor {name!r} has unsupported dtype {str(entry.get('dtype'))[:20]!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if type(shape) is not list or not _non_negative_ints(shape):
        unreadable(display, f"tensor {name!r} shape must be a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        unreadable(display, f"tensor {name!r} data_offsets must be two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        unreadable(display, f"tensor {name!r} byte range {offsets} lies outside the {data_size}-byte data section")
    if end - begin != math.prod(shape) * ITEM_SIZES[dtype_name]:  # type: ignore[index]
        unreadable(display, f"tensor {name!r} byte range {offsets} does not hold shape {shape}")
    return FileTensor(tuple(shape), dtype, descriptor, start + begin, end - begin, display, memory)


def _non_negative_ints(values: list[object]) -> bool:
    """Whether every value is an int (not a bool) of at least 0."""
    for value in values:  # noqa: SIM110 - a plain loop skips the generator's per-item cost on this hot path
        if type(value) is not int or value < 0:
            return False
    return True
