"""Assemble one bucket's samples into a batch: every tensor copied once into one buffer, prompts zero-padded.

A batch's tensors are views of one flat byte buffer (`BatchBuffer`). Sample tensors are either
`FileTensor`s still in their payload file, which the kernel copies straight into their place in
the buffer, or in memory (mapped `.pt` tensors that are not plain byte ranges, samples built by
hand). In a loader worker the buffer is shared memory, and the batch crosses to the training
process as that one buffer plus where each tensor lies in it (`SharedBatch`), instead of one
shared-memory hand-off per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import get_worker_info

from ..payload.file_tensor import FileTensor
from .buffer import BatchBuffer
from .shared_batch import SharedBatch

ALIGNMENT = 64  # every batch tensor starts on a cache line, so typed views of the buffer are aligned
Source = torch.Tensor | FileTensor
Key = TypeVar("Key")


class _Field(NamedTuple):
    """One batch tensor: where it goes in the batch dict, its shape, and each sample's part of it."""

    key: str
    name: str | int | None  # position in `context_latents` or name in `conditioning_tensors`
    shape: tuple[int, ...]  # batch shape: (batch, *sample shape); padded fields take the longest row
    dtype: torch.dtype
    sources: list[Source]


def collate_image_edit(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples of one compound signature into the batch contract of the cache format."""
    if isinstance(samples, AssembledSamples):  # the dataset already built this batch
        return samples.batch
    if not samples:
        raise ValueError("cannot collate an empty batch")
    fields = _batch_fields(samples)
    offsets, nbytes = layout(fields)
    buffer = BatchBuffer(nbytes, shared=get_worker_info() is not None)
    tensors = [place(buffer.tensor, offset, field) for field, offset in zip(fields, offsets)]
    try:
        fill(buffer, offsets, fields)
    except BaseException:
        if buffer.lease is not None:
            buffer.lease.cancel()
        raise
    batch = _batch_dict(samples, fields, tensors)
    if not buffer.shared:
        return batch
    return SharedBatch(batch, buffer.tensor, buffer.lease, placed_keys={field.key for field in fields})


def _batch_fields(samples: Sequence[dict[str, Any]]) -> list[_Field]:
    """The batch's tensors, after checking that every sample has the same compound signature."""
    first = samples[0]
    _check_same(samples, lambda s: form(s["target_latent"]), "target_latent shape/dtype", _shown_form)
    _check_same(
        samples,
        lambda s: tuple(form(c) for c in s["context_latents"]),
        "ordered context_latents shapes/dtypes",
        lambda forms: ", ".join(_shown_form(f) for f in forms),
    )
    _check_same(
        samples,
        lambda s: (s["prompt_embeddings"].shape[1], s["prompt_embeddings"].dtype),
        "prompt hidden size/dtype",
        lambda hidden: f"{hidden[0]} {dtype_name(hidden[1])}",
    )
    _check_same(samples, lambda s: s["prompt_attention_mask"].dtype, "prompt_attention_mask dtype", dtype_name)
    names = sorted(first["conditioning_tensors"])
    for i, sample in enumerate(samples[1:], start=1):
        if sorted(sample["conditioning_tensors"]) != names:
            raise ValueError(
                f"conditioning_tensors names differ within a batch: sample {i} has "
                f"{sorted(sample['conditioning_tensors'])}, sample 0 has {names}"
            )
    for name in names:
        _check_same(samples, _conditioning_form(name), f"conditioning tensor {name!r} shape/dtype", _shown_form)
    size = len(samples)
    longest = max(s["prompt_embeddings"].shape[0] for s in samples)
    embeddings = [s["prompt_embeddings"] for s in samples]
    masks = [s["prompt_attention_mask"] for s in samples]
    contexts = range(len(first["context_latents"]))
    return [
        stacked("image_latents", None, [s["target_latent"] for s in samples]),
        *(stacked("context_latents", i, [s["context_latents"][i] for s in samples]) for i in contexts),
        _Field("text_embeddings", None, (size, longest, embeddings[0].shape[1]), embeddings[0].dtype, embeddings),
        _Field("text_attention_mask", None, (size, longest), masks[0].dtype, masks),
        *(stacked("conditioning_tensors", n, [s["conditioning_tensors"][n] for s in samples]) for n in names),
    ]


def form(tensor: Source) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype, for comparing samples (formatted only for an error message)."""
    return tuple(tensor.shape), tensor.dtype


def _conditioning_form(name: str) -> Callable[[dict[str, Any]], tuple[tuple[int, ...], torch.dtype]]:
    """A sample's `form` of its conditioning tensor `name`."""
    return lambda sample: form(sample["conditioning_tensors"][name])


def _shown_form(shape_and_dtype: tuple[tuple[int, ...], torch.dtype]) -> str:
    """A `form` as an error message shows it: `[4, 8, 8] float32`."""
    shape, dtype = shape_and_dtype
    return f"{list(shape)} {dtype_name(dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


def stacked(key: str, name: str | int | None, sources: list[Source]) -> _Field:
    """A field whose samples all have one shape, stacked along a new batch dimension."""
    return _Field(key, name, (len(sources), *sources[0].shape), sources[0].dtype, sources)


def _check_same(
    samples: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Key], what: str, shown: Callable[[Key], str]
) -> None:
    """Refuse a batch whose samples disagree on `key` (one compound signature per batch); `shown` formats a key."""
    values = [key(s) for s in samples]
    first = values[0]
    for differing, value in enumerate(values):
        if value != first:
            raise ValueError(
                f"a batch must hold one compound signature: {what} of sample {differing} is {shown(value)}, "
                f"sample 0 has {shown(first)}"
            )


def layout(fields: Sequence[_Field]) -> tuple[list[int], int]:
    """Byte offset of each field in the batch buffer, and the buffer's size."""
    offsets, end = [], 0
    for field in fields:
        end = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(end)
        end += _field_bytes(field)
    return offsets, end


def _field_bytes(field: _Field) -> int:
    """Bytes one field takes in the buffer."""
    numel = 1
    for size in field.shape:
        numel *= size
    return numel * field.dtype.itemsize


def place(buffer: torch.Tensor, offset: int, field: _Field) -> torch.Tensor:
    """The typed batch tensor of `field`: a view of its bytes in `buffer`."""
    nbytes = _field_bytes(field)
    return buffer[offset : offset + nbytes].view(field.dtype).view(field.shape)


def fill(buffer: BatchBuffer, offsets: Sequence[int], fields: Sequence[_Field]) -> None:
    """Copy every sample's part of every field into the buffer, zero-padding short prompt rows.

    Parts still in a file are collected per file and read in file order, so the contiguous tensors
    of one safetensors payload arrive with one system call.
    """
    reads: dict[int, list[tuple[int, int, FileTensor]]] = {}
    for field, offset in zip(fields, offsets):
        row_bytes = _field_bytes(field) // max(1, field.shape[0])
        for row, source in enumerate(field.sources):
            start = offset + row * row_bytes
            count = source.nbytes if isinstance(source, FileTensor) else source.numel() * source.element_size()
            if count < row_bytes:
                buffer.zero(start + count, start + row_bytes)
            if count == 0:
                continue
            if isinstance(source, FileTensor):
                reads.setdefault(source.descriptor, []).append((source.offset, start, source))
            else:
                buffer.copy(start, source)
    buffer.read_files([sorted(parts, key=lambda part: part[0]) for parts in reads.values()])


def _batch_dict(
    samples: Sequence[dict[str, Any]], fields: Sequence[_Field], tensors: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """The batch contract: tensors by key, token counts and where the batch came from."""
    by_key: dict[str, Any] = {"context_latents": [], "conditioning_tensors": {}}
    for field, tensor in zip(fields, tensors):
        if field.key == "context_latents":
            by_key["context_latents"].append(tensor)
        elif field.key == "conditioning_tensors":
            by_key["conditioning_tensors"][field.name] = tensor
        else:
            by_key[field.key] = tensor
    metadata = [s["metadata"] for s in samples]
    target_tokens = [int(m["target_token_length"]) for m in metadata]
    context_tokens = [int(sum(m["context_token_lengths"])) for m in metadata]
    text_tokens = [int(m["text_token_length"]) for m in metadata]
    total_tokens = [t + c + x for t, c, x in zip(target_tokens, context_tokens, text_tokens)]
    batch: dict[str, Any] = {
        "image_latents": by_key["image_latents"],
        "context_latents": by_key["context_latents"],
        "text_embeddings": by_key["text_embeddings"],
        "text_attention_mask": by_key["text_attention_mask"],
        "conditioning_tensors": by_key["conditioning_tensors"],
        "data_type": "image",
        "metadata": {
            "samples": metadata,
            "batch_size": len(samples),
            "target_token_counts": target_tokens,
            "context_token_counts": context_tokens,
            "text_token_counts": text_tokens,
            "total_token_counts": total_tokens,
            "target_token_count": sum(target_tokens),
            "context_token_count": sum(context_tokens),
            "text_token_count": sum(text_tokens),
            "total_token_count": sum(total_tokens),
        },
    }
    first = samples[0]
    if "position" in first:
        batch["metadata"]["position"] = list(first["position"])
    skipped = [entry for s in samples for entry in s.get("skipped", ())]
    if skipped or "skipped" in first:
        batch["metadata"]["skipped"] = len(skipped)
        batch["metadata"]["skipped_samples"] = skipped
    if all("sample_index" in s for s in samples):
        batch["metadata"]["sample_indices"] = [int(s["sample_index"]) for s in samples]
    return batch


class AssembledSamples(Sequence[dict[str, Any]]):
    """A batch's samples as the dataset returns them, with the batch already assembled.

    `collate_image_edit` returns `batch` as it is; any other collate function sees ordinary sample
    dicts, whose tensors are views of the batch's rows.
    """

    def __init__(self, batch: dict[str, Any], samples: Sequence[dict[str, Any]]) -> None:
        self.batch = batch
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = range(len(self))[index]
        sample = self._samples[row]
        batch = self.batch
        length = sample["prompt_embeddings"].shape[0]
        return {
            **sample,
            "target_latent": batch["image_latents"][row],
            "context_latents": [c[row] for c in batch["context_latents"]],
            "prompt_embeddings": batch["text_embeddings"][row, :length],
            "prompt_attention_mask": batch["text_attention_mask"][row, :length],
            "conditioning_tensors": {n: t[row] for n, t in batch["conditioning_tensors"].items()},
        }
