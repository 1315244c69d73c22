"""Read and write one sample payload: NeMo's `.pt` (weights-only torch.load) or our `.safetensors`.

The safetensors form stores the same fields without pickle: tensors under the names
`target_latent`, `context_latents.<i>`, `prompt_embeddings`, `prompt_attention_mask`,
`conditioning_tensors.<name>`, and the payload's `metadata` as JSON in the header under
`image_edit_data.metadata` (with `image_edit_data.format` = `1`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save as save_safetensors_bytes

from .atomic import write_bytes_atomic
from .errors import fail, show
from .file_tensor import FileTensor
from .paths import open_regular
from .safetensors_header import read_header

PayloadFormat = Literal["pt", "safetensors"]
FORMAT_KEY = "image_edit_data.format"
METADATA_KEY = "image_edit_data.metadata"
FORMAT_VERSION = "1"
CONTEXT_PREFIX = "context_latents."
CONDITIONING_PREFIX = "conditioning_tensors."


def format_of(path: str | Path) -> PayloadFormat:
    """Payload format from the file suffix (`.safetensors`, else NeMo's `.pt`)."""
    return "safetensors" if str(path).endswith(".safetensors") else "pt"


class OpenPayload:
    """One payload's fields, ready to be checked and read into a batch; close it when the batch is built.

    safetensors fields are `FileTensor`s of the still-open file (nothing read yet but the header);
    `.pt` fields are tensors mapped from the file by torch's weights-only loader.
    """

    def __init__(self, fields: dict[str, Any], descriptor: int | None = None) -> None:
        self.fields = fields
        self.descriptor = descriptor

    def close(self) -> None:
        """Close the payload file (a no-op for `.pt`, whose mapping lives as long as its tensors)."""
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None

    def __enter__(self) -> OpenPayload:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_payload(path: Path | str, display: str, opened: tuple[int, os.stat_result] | None = None) -> OpenPayload:
    """Open one payload without running any code from the file; its tensors are read later, once.

    `opened` is the descriptor and stat of `path` when the caller has opened it already (this
    function then owns the descriptor).
    """
    try:
        descriptor, info = opened or open_regular(path, display)
    except OSError as error:
        fail(display, "file", f"cannot be read: {error.strerror or error}")
    if format_of(path) == "safetensors":
        try:
            if info.st_size == 0:
                fail(display, "file", "is empty (0 bytes)")
            return OpenPayload(from_safetensors(descriptor, info.st_size, display), descriptor)
        except OSError as error:
            os.close(descriptor)
            fail(display, "file", f"cannot be read: {error.strerror or error}")
        except BaseException:
            os.close(descriptor)
            raise
    try:
        if info.st_size == 0:
            fail(display, "file", "is empty (0 bytes)")
        is_zip = os.pread(descriptor, 4, 0) == b"PK\x03\x04"
        if is_zip:
            check_zip_expansion(path, descriptor, info.st_size, display)
        legacy = None if is_zip else read_all(descriptor)  # torch's legacy format cannot be mapped
    except OSError as error:
        fail(display, "file", f"cannot be read: {error.strerror or error}")
    finally:
        os.close(descriptor)
    if legacy is None:
        return OpenPayload(from_torch_save(path, display, mapped=True))
    return OpenPayload(from_torch_save(io.BytesIO(legacy), display, mapped=False))


def read_all(descriptor: int) -> bytes:
    """The whole file behind `descriptor`."""
    with os.fdopen(os.dup(descriptor), "rb") as handle:
        return handle.read()


def from_torch_save(source: Path | str | io.BytesIO, display: str, mapped: bool) -> dict[str, Any]:
    """A `torch.save` payload through the weights-only unpickler, as a dict of fields."""
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as error:
        fail(display, "payload", f"refused by the weights-only loader ({unpickler_reason(error)})")
    except Exception as error:  # hostile bytes reach torch's parsers, which raise struct.error, IndexError, ...
        fail(display, "payload", f"not a readable torch.save file ({type(error).__name__}: {first_sentence(error)})")
    if not isinstance(loaded, dict):
        fail(display, "payload", f"expected a dict of cache fields, got {type(loaded).__name__}")
    return loaded


def load_payload(path: Path, display: str) -> dict[str, Any]:
    """One payload's fields with every tensor in memory (for tools; the loader reads via `open_payload`)."""
    with open_payload(path, display) as payload:
        return {name: materialized(value) for name, value in payload.fields.items()}


def materialized(value: Any) -> Any:
    """`value` with each `FileTensor` in it (also inside lists and dicts) read into a tensor."""
    if isinstance(value, FileTensor):
        return value.materialize()
    if isinstance(value, list):
        return [materialized(v) for v in value]
    if isinstance(value, dict):
        return {k: materialized(v) for k, v in value.items()}
    return value


def first_sentence(error: BaseException) -> str:
    """The part of a torch error that says what is wrong (it appends paragraphs of advice)."""
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(error))
    return text.split(". ")[0].split("  (Could this error")[0]


def unpickler_reason(error: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler refused (e.g. `... GLOBAL os.system whose module os is blocked`).

    torch wraps it in paragraphs of advice, some of which suggest loading unsafely; keep only the reason.
    """
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    elif "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    text = text.split("Check the documentation")[0].split(" Please use")[0]
    return " ".join(text.split()) or "no reason given"


def check_zip_expansion(path: Path | str, descriptor: int, size: int, display: str) -> None:
    """Refuse a torch zip that zipfile cannot read, or whose entries unpack to more than the file holds.

    torch.save stores entries uncompressed, but torch.load also inflates compressed ones, so a
    small file could otherwise expand into gigabytes (a compression bomb).
    """
    unpacked = central_directory_total(descriptor, size)
    if unpacked is None:  # not the plain layout torch.save writes: let zipfile read (or refuse) it
        try:
            with zipfile.ZipFile(path) as archive:
                entries = archive.infolist()
        except Exception as error:  # zipfile raises many types on damaged archives
            fail(display, "payload", f"not a readable torch.save file (damaged zip: {error})")
        unpacked = sum(entry.file_size for entry in entries)
    if unpacked > size:
        fail(display, "payload", f"zip entries unpack to {unpacked} bytes from a {size}-byte file")


END_RECORD = struct.Struct("<4s4H2LH")  # end of central directory: signature ... comment length
CENTRAL_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
ZIP64_MARK = 0xFFFFFFFF


def central_directory_total(descriptor: int, size: int) -> int | None:
    """Unpacked bytes of all entries, from the central directory of a zip as torch.save writes it.

    Two reads and no objects per entry (zipfile costs as much as the rest of a payload's checks).
    None for anything else (a comment, zip64 sizes, several disks, damage): zipfile then decides.
    """
    if size < END_RECORD.size:
        return None
    end = END_RECORD.unpack(os.pread(descriptor, END_RECORD.size, size - END_RECORD.size))
    signature, disk, directory_disk, disk_entries, entries, directory_size, directory_offset, comment = end
    if signature != b"PK\x05\x06" or disk or directory_disk or comment or disk_entries != entries:
        return None
    if ZIP64_MARK in (directory_size, directory_offset) or directory_offset + directory_size > size:
        return None
    directory = os.pread(descriptor, directory_size, directory_offset)
    total = position = 0
    for _ in range(entries):
        if position + CENTRAL_ENTRY.size > len(directory):
            return None
        entry = CENTRAL_ENTRY.unpack_from(directory, position)
        if entry[0] != b"PK\x01\x02" or ZIP64_MARK in (entry[8], entry[9]):
            return None
        total += entry[9]
        position += CENTRAL_ENTRY.size + entry[10] + entry[11] + entry[12]
    return total if position == len(directory) else None


def from_safetensors(descriptor: int, size: int, display: str) -> dict[str, Any]:
    """Rebuild the payload dict from our safetensors form, its tensors as `FileTensor`s of `descriptor`."""
    tensors, extra = read_header(descriptor, size, display)
    if extra.get(FORMAT_KEY) != FORMAT_VERSION:
        fail(
            display,
            FORMAT_KEY,
            f"expected {FORMAT_VERSION!r} (an image-edit-data payload), got {show(extra.get(FORMAT_KEY))}",
        )
    try:
        metadata = json.loads(extra.get(METADATA_KEY, "null"))
    except json.JSONDecodeError as error:
        fail(display, METADATA_KEY, f"invalid JSON: {error.msg}")
    except RecursionError:
        fail(display, METADATA_KEY, "invalid JSON: nesting is too deep")
    except ValueError as error:  # e.g. an integer literal longer than Python's 4300-digit limit
        fail(display, METADATA_KEY, f"invalid JSON: {error}")
    payload: dict[str, Any] = {
        "context_latents": context_list(tensors, display),
        "conditioning_tensors": {
            k[len(CONDITIONING_PREFIX) :]: v for k, v in tensors.items() if k.startswith(CONDITIONING_PREFIX)
        },
        "metadata": metadata,
    }
    for name in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
        if name in tensors:
            payload[name] = tensors[name]
    return payload


def context_list(tensors: Mapping[str, FileTensor], display: str) -> list[FileTensor]:
    """The `context_latents.<i>` tensors in order; the indices must be exactly 0, 1, ..., n-1."""
    by_index: dict[str, FileTensor] = {
        k[len(CONTEXT_PREFIX) :]: v for k, v in tensors.items() if k.startswith(CONTEXT_PREFIX)
    }
    expected = [str(i) for i in range(len(by_index))]
    if sorted(by_index) != sorted(expected):
        got = sorted(CONTEXT_PREFIX + k for k in by_index)
        fail(display, "context_latents", f"expected {CONTEXT_PREFIX}<i> for i = 0..{len(by_index) - 1}, got {got}")
    return [by_index[i] for i in expected]


def to_safetensors(payload: Mapping[str, Any]) -> bytes:
    """Serialise a payload dict into our safetensors form."""
    tensors: dict[str, torch.Tensor] = {
        "target_latent": payload["target_latent"],
        "prompt_embeddings": payload["prompt_embeddings"],
        "prompt_attention_mask": payload["prompt_attention_mask"],
    }
    for i, context in enumerate(payload["context_latents"]):
        tensors[f"{CONTEXT_PREFIX}{i}"] = context
    for name, tensor in (payload.get("conditioning_tensors") or {}).items():
        tensors[f"{CONDITIONING_PREFIX}{name}"] = tensor
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    header = {FORMAT_KEY: FORMAT_VERSION, METADATA_KEY: json.dumps(payload["metadata"])}
    return save_safetensors_bytes(tensors, metadata=header)


def save_payload(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write a payload atomically, in the format its suffix names."""
    if format_of(path) == "safetensors":
        data = to_safetensors(payload)
    else:
        buffer = io.BytesIO()
        torch.save({k: v for k, v in payload.items()}, buffer)
        data = buffer.getvalue()
    write_bytes_atomic(path, data)
