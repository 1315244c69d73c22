"""A `.pt` payload's tensors as `FileTensor`s: read straight from the file into the batch, like safetensors.

Unpickled onto the meta device (by `pt_structure`, or by torch's own meta loading), each storage
notes where its bytes start in the file (`_checkpoint_offset`). A tensor that is one plain byte
range inside a stored zip entry becomes a `FileTensor`; anything else (a strided or expanded
view, a storage that is not an entry, a tensor outside the cache fields) makes the caller load
the payload the usual way, so the contract checks see real tensors.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import fail
from ..file_tensor import FileTensor

TENSOR_FIELDS = ("target_latent", "prompt_embeddings", "prompt_attention_mask")


class NotAByteRange(Exception):
    """A tensor the batch cannot read straight from its file."""


@functools.cache
def torch_notes_storage_offsets() -> bool:
    """Whether this torch's loader notes storage offsets when loading onto the meta device."""
    saved = io.BytesIO()
    torch.save(torch.zeros(1), saved)
    saved.seek(0)
    loaded = torch.load(saved, map_location="meta", weights_only=True)
    return isinstance(getattr(loaded.untyped_storage(), "_checkpoint_offset", None), int)


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
