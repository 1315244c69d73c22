"""Read a safetensors file as tensor *views* of a memory map: no copy until the batch is stacked.

The header is checked before any view exists: known dtypes only, every tensor's byte range inside
the data section and exactly `prod(shape) * itemsize` long. A header that declares a gigantic
shape therefore fails on arithmetic, never on an allocation.
"""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path
from typing import NoReturn

import torch

from .validate import fail

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
MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


def unreadable(display: str, reason: str) -> NoReturn:
    """The one error for a damaged or hostile safetensors file."""
    fail(display, "payload", f"not a readable safetensors file ({reason})")


def read_views(path: Path, display: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (copy-on-write views of the file's pages) and the string metadata of a safetensors file."""
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        if size < 8:
            unreadable(display, f"{size} bytes, shorter than the 8-byte header length")
        # Copy-on-write: writable views without a warning, pages shared with the page cache until written.
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    header_length = int.from_bytes(mapped[:8], "little")
    if header_length > min(MAX_HEADER, size - 8):
        unreadable(display, f"header length {header_length} exceeds the {size}-byte file")
    try:
        header = json.loads(mapped[8 : 8 + header_length])
    except (UnicodeDecodeError, RecursionError, ValueError) as error:
        unreadable(display, f"header is not JSON: {str(error)[:200]}")
    if not isinstance(header, dict):
        unreadable(display, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        unreadable(display, "__metadata__ must map names to strings")
    data_start = 8 + header_length
    data_size = size - data_start
    tensors = {name: view(mapped, data_start, data_size, name, entry, display) for name, entry in header.items()}
    return tensors, metadata


def view(mapped: mmap.mmap, start: int, data_size: int, name: str, entry: object, display: str) -> torch.Tensor:
    """One checked tensor view into the mapped data section."""
    if not isinstance(entry, dict):
        unreadable(display, f"entry {name!r} is not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        unreadable(display, f"tensor {name!r} has unsupported dtype {str(entry.get('dtype'))[:20]!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        unreadable(display, f"tensor {name!r} shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        unreadable(display, f"tensor {name!r} data_offsets must be two integers")
    begin, end = offsets
    numel = math.prod(shape)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end <= data_size:
        unreadable(display, f"tensor {name!r} byte range {offsets} lies outside the {data_size}-byte data section")
    if end - begin != expected:
        unreadable(display, f"tensor {name!r} byte range {offsets} does not hold shape {shape}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapped, dtype=dtype, count=numel, offset=start + begin).view(shape)
