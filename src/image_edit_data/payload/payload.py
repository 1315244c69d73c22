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
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save as save_safetensors_bytes

from .._atomic import write_bytes_atomic
from .._retry import with_read_retries
from ..contract.file_tensor import FileTensor
from ..contract.paths import open_regular
from ..errors import CacheFormatError, fail, read_failed, show
from .member_check import Buffer, FetchedMember, FileMember, MemberCheck
from .safetensors_header import header_from_bytes, read_header
from .torch_save._private_torch import direct_reads, in_file_payload
from .torch_save.torch_zip import ZipEntry, stored_data_ranges, zip_entries

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

    Tensors are `FileTensor`s of the still-open file or of fetched bytes (nothing read yet but the
    header or the pickle), or, for `.pt` files whose tensors are not plain byte ranges of the file,
    tensors that torch's weights-only loader mapped from it or read into memory. `check` is the
    member checksum still to compare (packed members), which the batch computes as it reads the
    tensors (`batch/fill.py`); `descriptor` is the file this payload owns (None: none, or one its
    reader keeps open for many payloads, which `release` then tells when this payload is closed).
    """

    def __init__(
        self,
        fields: dict[str, Any],
        descriptor: int | None = None,
        check: MemberCheck | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.fields = fields
        self.descriptor = descriptor
        self.check = check
        self.release = release  # tells a shared descriptor's keeper that this payload is done with it

    def close(self) -> None:
        """Close the payload file (a no-op for mapped `.pt` tensors, whose mapping lives as long as they do)."""
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None
        if self.release is not None:
            self.release()
            self.release = None

    def __enter__(self) -> OpenPayload:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_payload(
    path: Path | str,
    display: str,
    opened: tuple[int, os.stat_result] | None = None,
    member: tuple[int, int] | None = None,
    checksum: int | None = None,
) -> OpenPayload:
    """Open one payload without running any code from the file; its tensors are read later, once.

    `opened` is the descriptor and stat of `path` when the caller has opened it already (this
    function then owns the descriptor). `member` is `(offset, length)` of a safetensors payload
    stored inside a larger file (a packed tar shard, see index/packed.py), and `checksum` its
    recorded XXH3-64, checked as the batch reads it.
    """
    try:
        descriptor, info = opened or with_read_retries(lambda: open_regular(path, display), display)
    except OSError as error:
        read_failed(display, error)
    try:
        if member is not None or format_of(path) == "safetensors":
            where = member if member is not None else (0, info.st_size)
            return open_member(descriptor, display, where, checksum, f"read from {path}", owned=True)
        size = info.st_size
        fields, in_file = with_read_retries(lambda: _torch_save_fields(path, descriptor, size, display), display)
    except OSError as error:
        os.close(descriptor)
        read_failed(display, error)
    except BaseException:
        os.close(descriptor)
        raise
    if in_file:
        return OpenPayload(fields, descriptor)
    os.close(descriptor)
    return OpenPayload(fields)


def open_member(
    descriptor: int,
    display: str,
    member: tuple[int, int],
    checksum: int | None = None,
    source: str = "",
    owned: bool = False,
    release: Callable[[], None] | None = None,
) -> OpenPayload:
    """The safetensors payload at `member` = `(offset, length)` of an open file, its header read and checked.

    With `owned` the payload closes `descriptor` when it is closed; otherwise the descriptor stays
    the caller's, shared by many payloads, and `release` (if given) is called when the payload is
    closed. If this raises, the caller still holds both. A member whose header cannot be parsed is
    read again whole when it has a `checksum`: damage the checksum confirms is reported as such, and
    intact bytes (the first read was not) are parsed from memory.
    """
    base, size = member
    if size == 0:
        fail(display, "file", "is empty (0 bytes)")
    kept = descriptor if owned else None
    try:
        tensors, extra, head = with_read_retries(lambda: read_header(descriptor, size, display, base), display)
        fields = fields_from_header(tensors, extra, display)
    except OSError as error:
        read_failed(display, error)
    except CacheFormatError:
        if checksum is None:
            raise
        fresh = confirmed_or_raise(FileMember(checksum, display, source, descriptor, base, size, b""))
        return OpenPayload(payload_from_bytes(fresh, display).fields, kept, None, release)  # checked already
    return OpenPayload(
        fields,
        kept,
        None if checksum is None else FileMember(checksum, display, source, descriptor, base, size, head),
        release,
    )


def payload_from_bytes(
    data: Buffer,
    display: str,
    member_checksum: int | None = None,
    *,
    source: str = "fetched",
    refetch: Callable[[], Buffer] | None = None,
) -> OpenPayload:
    """A safetensors payload (a packed member, or a `.safetensors` file) from bytes already in memory.

    For readers that fetch bytes (remote caches): the tensors are `FileTensor`s over `data`, which
    the batch copies once into its memory, and `member_checksum` (the index's XXH3-64 of these
    bytes) is computed in that same pass. On a mismatch the batch calls `refetch` for the bytes
    once more (without it, the same bytes are hashed again) before the member counts as damaged.
    `source` says where the bytes came from in that error ("ranged read of s3://...").
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    check = None if member_checksum is None else FetchedMember(member_checksum, display, source, view, refetch)
    try:
        tensors, extra = header_from_bytes(view, display)
        fields = fields_from_header(tensors, extra, display)
    except CacheFormatError:
        if check is None:
            raise
        return payload_from_bytes(confirmed_or_raise(check), display)  # checked already
    return OpenPayload(fields, None, check)


def confirmed_or_raise(check: MemberCheck) -> Buffer:
    """The member read again when it now matches its checksum; the confirmed mismatch is raised."""
    result = check.confirmed()
    if isinstance(result, CacheFormatError):
        raise result
    return result


def _torch_save_fields(path: Path | str, descriptor: int, size: int, display: str) -> tuple[dict[str, Any], bool]:
    """A `torch.save` payload's fields, and whether its tensors are `FileTensor`s of `descriptor`.

    Where torch's private path works (`torch_save/_private_torch.py`), the weights-only unpickler
    builds only the structure and the batch later reads the bytes straight into its own memory, as
    for safetensors. Otherwise `torch.load(weights_only=True)` maps the tensors from the file (when
    its data entries are stored) or loads them into memory (compressed entries, the other byte
    order, another zip layout), and the batch copies them.
    """
    if size == 0:
        fail(display, "file", "is empty (0 bytes)")
    if os.pread(descriptor, 4, 0) != b"PK\x03\x04":  # torch's legacy format cannot be mapped
        return _from_torch_save(io.BytesIO(read_all(descriptor)), display, mapped=False), False
    entries = zip_entries(descriptor, size)
    _check_zip_expansion(path, entries, size, display)
    ranges = None if entries is None else stored_data_ranges(descriptor, entries, size)
    if entries is not None and ranges is not None and direct_reads():
        in_file = in_file_payload(descriptor, entries, ranges, size, display)
        if in_file is not None:
            return in_file, True
    # torch maps compressed entries as if they were stored (wrong values): map only stored ones.
    fields = _from_torch_save(path, display, mapped=ranges is not None)
    if ranges is not None:
        _check_storages_fit(fields, dict(ranges.values()), display)
    return fields, False


def _check_storages_fit(fields: dict[str, Any], entry_ends: Mapping[int, int], display: str) -> None:
    """Refuse a mapped payload whose tensor storage runs past its zip entry (into the next entry).

    `torch.load(mmap=True)` maps the whole file and places each storage at its entry's start, so the
    storages' addresses, less the one address of the file's start, must be entry starts.
    """
    storages = {}
    pending: list[Any] = [fields]
    while pending:  # without recursion: pickles nest deep
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.layout != torch.strided or item.device.type != "cpu":
                continue  # the contract checks name what it is
            storage = item.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    if not storages:
        return
    lowest = min(storages)
    for base in sorted({lowest - start for start in entry_ends}, reverse=True):
        if all(address - base in entry_ends for address in storages):
            for address, nbytes in storages.items():
                start = address - base
                if nbytes > entry_ends[start] - start:
                    fail(
                        display,
                        "payload",
                        f"a tensor storage needs {nbytes} bytes, its zip entry holds {entry_ends[start] - start}",
                    )
            return
    fail(display, "payload", "a tensor storage does not start at a zip entry of the file")


def _check_zip_expansion(path: Path | str, entries: list[ZipEntry] | None, size: int, display: str) -> None:
    """Refuse a torch zip that zipfile cannot read, or whose entries unpack to more than the file holds.

    torch.save stores entries uncompressed, but torch.load also inflates compressed ones, so a
    small file could otherwise expand into gigabytes (a compression bomb). `entries` is the
    central directory when it has the plain layout torch.save writes, else zipfile reads it.
    """
    if entries is None:
        try:
            with zipfile.ZipFile(path) as archive:
                unpacked = sum(entry.file_size for entry in archive.infolist())
        except Exception as error:  # zipfile raises many types on damaged archives
            fail(display, "payload", f"not a readable torch.save file (damaged zip: {error})")
    else:
        unpacked = sum(entry.unpacked_size for entry in entries)
    if unpacked > size:
        fail(display, "payload", f"zip entries unpack to {unpacked} bytes from a {size}-byte file")


def read_all(descriptor: int) -> bytes:
    """The whole file behind `descriptor`."""
    with os.fdopen(os.dup(descriptor), "rb") as handle:
        return handle.read()


def _from_torch_save(source: Path | str | io.BytesIO, display: str, mapped: bool) -> dict[str, Any]:
    """A `torch.save` payload through the weights-only unpickler, as a dict of fields."""
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as error:
        fail(display, "payload", f"refused by the weights-only loader ({_unpickler_reason(error)})")
    except Exception as error:  # hostile bytes reach torch's parsers, which raise struct.error, IndexError, ...
        fail(display, "payload", f"not a readable torch.save file ({type(error).__name__}: {_first_sentence(error)})")
    if not isinstance(loaded, dict):
        fail(display, "payload", f"expected a dict of cache fields, got {type(loaded).__name__}")
    return loaded


def load_payload(path: Path, display: str) -> dict[str, Any]:
    """One payload's fields with every tensor in memory (for tools; the loader reads via `open_payload`)."""
    with open_payload(path, display) as payload:
        return {name: materialized(value) for name, value in payload.fields.items()}


def materialized(value: Any, member: Buffer | None = None, base: int = 0) -> Any:
    """`value` with each `FileTensor` in it (also inside lists and dicts) read into a tensor of its own.

    With `member` (a packed member's checked bytes, starting at offset `base` of its file) the tensors
    are copied from those bytes rather than read from the file again.
    """
    if isinstance(value, FileTensor):
        if member is None:
            return value.materialize()
        start = value.offset - base
        return FileTensor(
            value.shape, value.dtype, -1, start, value.nbytes, value.display, memoryview(member)
        ).materialize()
    if isinstance(value, list):
        return [materialized(v, member, base) for v in value]
    if isinstance(value, dict):
        return {k: materialized(v, member, base) for k, v in value.items()}
    return value


def _first_sentence(error: BaseException) -> str:
    """The part of a torch error that says what is wrong (it appends paragraphs of advice)."""
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", str(error))
    return text.split(". ")[0].split("  (Could this error")[0]


def _unpickler_reason(error: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler refused (e.g. `... GLOBAL os.system whose module os is blocked`).

    torch wraps it in paragraphs of advice, some of which suggest loading unsafely; keep only the reason.
    """
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    elif text.startswith("Weights only load failed"):  # its first line is advice, the reason follows
        text = text.split("\n", 1)[1] if "\n" in text else ""
    text = text.split("Check the documentation")[0].split(" Please use")[0]
    return " ".join(text.split()) or "no reason given"


def from_safetensors(descriptor: int, size: int, display: str, base: int = 0) -> dict[str, Any]:
    """Rebuild the payload dict from our safetensors form, its tensors as `FileTensor`s of `descriptor`."""
    tensors, extra, _ = read_header(descriptor, size, display, base)
    return fields_from_header(tensors, extra, display)


def fields_from_header(tensors: Mapping[str, FileTensor], extra: Mapping[str, str], display: str) -> dict[str, Any]:
    """The payload dict from a checked safetensors header: its tensors by field, its metadata parsed."""
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
        "context_latents": _context_list(tensors, display),
        "conditioning_tensors": {
            k[len(CONDITIONING_PREFIX) :]: v for k, v in tensors.items() if k.startswith(CONDITIONING_PREFIX)
        },
        "metadata": metadata,
    }
    for name in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
        if name in tensors:
            payload[name] = tensors[name]
    return payload


def _context_list(tensors: Mapping[str, FileTensor], display: str) -> list[FileTensor]:
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
