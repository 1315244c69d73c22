"""A `torch.save` payload's structure from torch's weights-only unpickler, without `torch.load` around it.

`torch.load(map_location="meta", weights_only=True)` spends much of a small payload's time
outside the unpickler: opening its own zip reader, and device and fake-mode checks for every
storage. Here the pickle is read with one `pread` from the zip entries the caller has parsed and
run through the same unpickler `weights_only=True` runs (`torch._weights_only_unpickler`, so the
same globals are allowed and refused); each storage becomes a meta storage that notes where its
bytes start in the file, as torch's own meta loading does. Whenever anything is unusual (a
layout, a refusal, a torch whose internals differ) this gives None and the caller uses
`torch.load`, which then reports the problem in its usual words.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from .torch_zip import ZipEntry, data_range, stored_data_ranges, zip_entries

PICKLE_NAME = b"data.pkl"


class _UnusualPayload(Exception):
    """A payload this path leaves to `torch.load`."""


def structure_on_meta(
    descriptor: int, entries: list[ZipEntry], data_ranges: Mapping[bytes, tuple[int, int]], size: int
) -> dict[str, Any] | None:
    """The payload unpickled onto the meta device (each storage noting its file offset), or None.

    `data_ranges` maps each tensor data entry's name to its bytes `[start, end)` in the file.
    """
    if not direct_unpickling_works():
        return None
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
