"""Torch's private API for `.pt` payloads, kept in this one module: it reads a small payload much faster.

`torch.load(weights_only=True, mmap=True)` spends much of a small payload's time outside the
unpickler: its own zip reader, device and fake-mode checks for every storage, then a copy through a
mapping. Here the pickle is read with one `pread` from the zip entries the caller has parsed and run
through the unpickler `weights_only=True` runs (`torch._weights_only_unpickler.Unpickler`, so the
same globals are allowed and refused). Each storage becomes a meta storage (`TypedStorage(...,
_internal=True)`) that notes where its bytes start in the file (`_checkpoint_offset`, as recent
torch's meta loading does), and each tensor that is one plain byte range of a stored entry becomes
a `FileTensor`, which the batch reads straight from the file, as for safetensors.

The interleaved A/B that justifies it is in docs/performance.md. A self-check at first use compares
this path with `torch.load` on a small payload; where it fails (a torch whose internals differ), or
with IMAGE_EDIT_DATA_PUBLIC_PT=1, payloads load with `torch.load(mmap=True)` instead. Which path
runs is logged once per process. Any payload this path does not take (a refusal, an unusual layout
or view) goes through `torch.load` too, which then reports the problem in its usual words.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from ...contract.file_tensor import FileTensor
from ...errors import fail
from .torch_zip import ZipEntry, data_range, stored_data_ranges, zip_entries

log = logging.getLogger(__name__)
PUBLIC_ENV = "IMAGE_EDIT_DATA_PUBLIC_PT"  # 1: use torch.load(mmap=True) even where this path works
_DIRECT: bool | None = None

PICKLE_NAME = b"data.pkl"


class _UnusualPayload(Exception):
    """A payload this path leaves to `torch.load`."""


def direct_reads() -> bool:
    """Whether `.pt` payloads are read through this module; logs which path is in use, once per process."""
    global _DIRECT
    if _DIRECT is None:
        version = torch.__version__
        if os.environ.get(PUBLIC_ENV, "") == "1":
            _DIRECT = False
            log.info(
                "image-edit-data: .pt payloads load with torch.load(weights_only=True, mmap=True) (%s=1)", PUBLIC_ENV
            )
        elif direct_unpickling_works():
            _DIRECT = True
            log.info("image-edit-data: .pt payloads read with torch %s's private weights-only Unpickler", version)
        else:
            _DIRECT = False
            log.warning(
                "image-edit-data: torch %s's private weights-only Unpickler does not match torch.load here; "
                ".pt payloads load with torch.load(weights_only=True, mmap=True), which is slower",
                version,
            )
    return _DIRECT


def in_file_payload(
    descriptor: int, entries: list[ZipEntry], data_ranges: Mapping[bytes, tuple[int, int]], size: int, display: str
) -> dict[str, Any] | None:
    """The payload with its cache tensors as `FileTensor`s of `descriptor`, or None to load it with torch.

    Refuses (raises) a storage longer than its zip entry.
    """
    structure = structure_on_meta(descriptor, entries, data_ranges, size)
    if structure is None:
        return None
    return in_file_fields(structure, descriptor, dict(data_ranges.values()), display)


def structure_on_meta(
    descriptor: int, entries: list[ZipEntry], data_ranges: Mapping[bytes, tuple[int, int]], size: int
) -> dict[str, Any] | None:
    """The payload unpickled onto the meta device (each storage noting its file offset), or None.

    `data_ranges` maps each tensor data entry's name to its bytes `[start, end)` in the file.
    """
    try:
        loaded = unpickled(descriptor, entries, data_ranges, size)
    except Exception:  # refused or unusual: torch.load says what is wrong
        return None
    return loaded if isinstance(loaded, dict) else None


def unpickled(descriptor: int, entries: list[ZipEntry], data_ranges: Mapping[bytes, tuple[int, int]], size: int) -> Any:
    """Run the weights-only unpickler over the file's `<archive>/data.pkl`; raises on anything unusual."""
    pickles = [entry for entry in entries if entry.name.endswith(b"/" + PICKLE_NAME)]
    if len(pickles) != 1 or pickles[0].name.count(b"/") != 1:
        raise _UnusualPayload("not exactly one <archive>/data.pkl")
    archive = pickles[0].name[: -len(PICKLE_NAME)]
    found = data_range(descriptor, pickles[0], size)
    if found is None:
        raise _UnusualPayload("data.pkl is compressed or damaged")
    start, end = found
    pickle_bytes = os.pread(descriptor, end - start, start)
    if len(pickle_bytes) != end - start:
        raise _UnusualPayload("data.pkl is cut short")

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise _UnusualPayload(f"persistent id {saved_id!r}")
        typename, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if typename not in ("storage", b"storage") or not isinstance(dtype, torch.dtype):
            raise _UnusualPayload(f"persistent id {saved_id!r}")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise _UnusualPayload(f"persistent id {saved_id!r}")
        data = data_ranges.get(archive + b"data/" + key.encode())
        if data is None:
            raise _UnusualPayload(f"storage {key!r} is not a data entry")
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")  # pt_in_file checks it fits
        storage._checkpoint_offset = data[0]  # the attribute torch's meta loading sets; pt_in_file reads it
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler_class()(io.BytesIO(pickle_bytes), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    return unpickler.load()


def _weights_only_unpickler_class() -> Any:
    """The unpickler class `torch.load(weights_only=True)` runs (a private module of torch)."""
    from torch import _weights_only_unpickler

    return _weights_only_unpickler.Unpickler


@functools.cache
def direct_unpickling_works() -> bool:
    """Whether this torch's weights-only unpickler, run directly, gives what `torch.load` gives onto meta.

    Checked once per process on a small saved payload (several dtypes, a view at an offset), so a
    torch whose internals differ falls back to `torch.load` instead of misreading payloads.
    """
    base = torch.arange(12, dtype=torch.float32)
    sample = {"view": base[4:], "whole": base, "half": torch.ones(3, 2, dtype=torch.bfloat16), "meta": {"a": [1]}}
    saved = io.BytesIO()
    torch.save(sample, saved)
    data = saved.getvalue()
    expected = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    try:
        with tempfile.TemporaryFile() as handle:
            handle.write(data)
            handle.flush()
            descriptor = handle.fileno()
            entries = zip_entries(descriptor, len(data))
            ranges = None if entries is None else stored_data_ranges(descriptor, entries, len(data))
            if entries is None or ranges is None:
                return False
            got = unpickled(descriptor, entries, ranges, len(data))
    except Exception:
        return False
    return same_structure(got, expected)


def same_structure(got: Any, expected: Any) -> bool:
    """Equal plain values, and tensors equal in shape, dtype, strides, storage offset and file offset.

    Recursive: meant for the small structures of the self-check and tests, not for payloads.
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.device.type != "meta":
            return False
        facts = [(t.shape, t.dtype, t.stride(), t.storage_offset()) for t in (got, expected)]
        offsets = [getattr(t.untyped_storage(), "_checkpoint_offset", None) for t in (got, expected)]
        return facts[0] == facts[1] and (offsets[1] is None or offsets[0] == offsets[1])
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(same_structure(got[key], value) for key, value in expected.items())
        )
    if isinstance(expected, (list, tuple)):
        return (
            type(got) is type(expected)
            and len(got) == len(expected)
            and all(same_structure(have, want) for have, want in zip(got, expected))
        )
    return type(got) is type(expected) and bool(got == expected)


TENSOR_FIELDS = ("target_latent", "prompt_embeddings", "prompt_attention_mask")


class NotAByteRange(Exception):
    """A tensor the batch cannot read straight from its file."""


def in_file_fields(
    structure: dict[str, Any], descriptor: int, entry_ends: Mapping[int, int], display: str
) -> dict[str, Any] | None:
    """The payload with its cache tensors as `FileTensor`s of `descriptor`, or None if one cannot be.

    `structure` is the payload loaded onto the meta device; `entry_ends` maps where each stored
    data entry of the file starts to where it ends, and every storage must be one of them.
    """

    def in_file(value: Any) -> Any:
        return file_tensor(value, descriptor, entry_ends, display)

    fields = dict(structure)
    try:
        for name in TENSOR_FIELDS:
            if name in fields:
                fields[name] = in_file(fields[name])
        if isinstance(fields.get("context_latents"), list):
            fields["context_latents"] = [in_file(value) for value in fields["context_latents"]]
        if isinstance(fields.get("conditioning_tensors"), dict):
            fields["conditioning_tensors"] = {k: in_file(v) for k, v in fields["conditioning_tensors"].items()}
    except NotAByteRange:
        return None
    return None if _holds_tensor(fields) else fields


def file_tensor(value: Any, descriptor: int, entry_ends: Mapping[int, int], display: str) -> Any:
    """A meta tensor as the `FileTensor` of its bytes in the file; anything else but a tensor as it is.

    A storage longer than its zip entry is refused here: torch's mapped loading would read past
    the entry into the next one without a word.
    """
    if not isinstance(value, torch.Tensor):
        return value  # the contract checks name what it is
    if value.device.type != "meta" or value.layout != torch.strided:
        raise NotAByteRange
    storage = value.untyped_storage()
    start = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(start, int) or (end := entry_ends.get(start)) is None:
        raise NotAByteRange
    if storage.nbytes() > end - start:
        fail(display, "payload", f"a tensor storage needs {storage.nbytes()} bytes, its zip entry holds {end - start}")
    if not value.is_contiguous():
        raise NotAByteRange
    skipped = int(value.storage_offset()) * value.element_size()
    nbytes = value.numel() * value.element_size()
    if nbytes and skipped + nbytes > storage.nbytes():
        raise NotAByteRange
    return FileTensor(tuple(value.shape), value.dtype, descriptor, start + skipped, nbytes, display)


def _holds_tensor(value: Any) -> bool:
    """Whether a torch tensor is left anywhere in `value` (walked without recursion: pickles nest deep)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            return True
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return False
