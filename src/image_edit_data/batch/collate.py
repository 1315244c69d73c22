"""Assemble one bucket's samples into a batch: every tensor copied once into one buffer, prompts zero-padded.

A batch's tensors are views of one flat byte buffer (`BatchBuffer`). Sample tensors are either
`FileTensor`s still in their payload file (or in fetched bytes), which are copied straight into
their place in the buffer, packed members' checksums computed in the same pass (`fill.py`), or
in memory (mapped `.pt` tensors that are not plain byte ranges, samples built by hand). In a
loader worker the buffer is shared memory, and the batch crosses to the training process as that
one buffer plus where each tensor lies in it (`SharedBatch`), instead of one shared-memory
hand-off per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast, overload

import torch
from torch.utils.data import get_worker_info

from ..contract.batch import EDIT_MASK, Batch, BatchMetadata, Sample, SkippedSample
from ..contract.file_tensor import FileTensor
from ..payload.member_check import Buffer, MemberCheck
from .buffer import BatchBuffer
from .fill import Mismatch, Placed, fill_rows
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
    sources: Sequence[Source]


def collate_image_edit(
    samples: Sequence[Sample] | AssembledBatch,
    *,
    position: tuple[int, int] | None = None,
    skipped: list[SkippedSample] | None = None,
    sources: Sequence[str] | None = None,
) -> Batch:
    """Collate samples of one compound signature into the batch contract of the cache format.

    `position` (epoch, step in the epoch plan), `skipped` (the samples dropped from this batch
    under the "skip" policy, possibly none) and `sources` (each sample's source in a mixture) go
    into the batch metadata when given. A batch the dataset already assembled is returned as it is.
    """
    if isinstance(samples, AssembledBatch):
        return samples.batch
    return assemble(samples, position=position, skipped=skipped, sources=sources).batch


@dataclass
class Assembly:
    """A batch just assembled, with the rows whose member checksums did not match as read."""

    batch: Batch
    buffer: BatchBuffer
    mismatches: list[Mismatch]

    def patch(self, mismatch: Mismatch, member: Buffer) -> None:
        """Replace a row's member tensors with the member's bytes read again, which matched its checksum."""
        mismatch.patch(self.buffer, member)

    def discard(self) -> None:
        """Give the batch's memory back unsent (the batch is assembled again without a damaged row)."""
        if self.buffer.lease is not None:
            self.buffer.lease.cancel()


def assemble(
    samples: Sequence[Sample],
    *,
    checks: Sequence[MemberCheck | None] | None = None,
    position: tuple[int, int] | None = None,
    skipped: list[SkippedSample] | None = None,
    sources: Sequence[str] | None = None,
) -> Assembly:
    """`collate_image_edit`, also checking each sample's member checksum (`checks`, one per sample) as it is read."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    if sources is not None and len(sources) != len(samples):
        raise ValueError(f"sources names {len(sources)} sources for a batch of {len(samples)} samples")
    fields = _batch_fields(samples)
    offsets, nbytes = layout(fields)
    buffer = BatchBuffer(nbytes, shared=get_worker_info() is not None)
    tensors = [place(buffer.tensor, offset, field) for field, offset in zip(fields, offsets)]
    try:
        mismatches = fill(buffer, offsets, fields, checks or [None] * len(samples))
    except BaseException:
        if buffer.lease is not None:
            buffer.lease.cancel()
        raise
    batch = _batch_dict(samples, fields, tensors, position, skipped)
    if sources is not None:
        batch["metadata"]["sources"] = list(sources)
    if buffer.shared:
        # A dict at run time: the batch, handed to the training process through its one shared buffer.
        placed_keys = {f.key for f in fields}
        batch = cast(Batch, SharedBatch(cast(dict[str, Any], batch), buffer.tensor, buffer.lease, placed_keys))
    return Assembly(batch, buffer, mismatches)


def _batch_fields(samples: Sequence[Sample]) -> list[_Field]:
    """The batch's tensors, after checking that every sample has the same compound signature."""
    first = samples[0]
    _check_same(samples, lambda s: form(s["target_latent"]), "target_latent shape/dtype", _shown_form)
    _check_same(
        samples,
        lambda s: tuple(form(c) for c in s["context_latents"]),
        "ordered context_latents shapes/dtypes",
        lambda forms: ", ".join(_shown_form(f) for f in forms) or "none (a text-to-image row)",
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
        if (EDIT_MASK in sample["conditioning_tensors"]) != (EDIT_MASK in names):
            has = ("has no", "has one") if EDIT_MASK in names else ("has one", "has none")
            raise ValueError(
                f"a batch must hold one compound signature: masked and unmasked samples never share a batch, "
                f"but sample {i} {has[0]} {EDIT_MASK} and sample 0 {has[1]}"
            )
        if sorted(sample["conditioning_tensors"]) != names:
            raise ValueError(
                f"conditioning_tensors names differ within a batch: sample {i} has "
                f"{sorted(sample['conditioning_tensors'])}, sample 0 has {names}"
            )
    for name in names:
        rule = "a conditioning tensor must have the same shape and dtype in every sample"
        _check_same(samples, _conditioning_form(name), f"conditioning tensor {name!r} shape/dtype", _shown_form, rule)
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


def _conditioning_form(name: str) -> Callable[[Sample], tuple[tuple[int, ...], torch.dtype]]:
    """A sample's `form` of its conditioning tensor `name`."""
    return lambda sample: form(sample["conditioning_tensors"][name])


def _shown_form(shape_and_dtype: tuple[tuple[int, ...], torch.dtype]) -> str:
    """A `form` as an error message shows it: `[4, 8, 8] float32`."""
    shape, dtype = shape_and_dtype
    return f"{list(shape)} {dtype_name(dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


def stacked(key: str, name: str | int | None, sources: Sequence[Source]) -> _Field:
    """A field whose samples all have one shape, stacked along a new batch dimension."""
    return _Field(key, name, (len(sources), *sources[0].shape), sources[0].dtype, sources)


def _check_same(
    samples: Sequence[Sample], key: Callable[[Sample], Key], what: str, shown: Callable[[Key], str], rule: str = ""
) -> None:
    """Refuse a batch whose samples disagree on `key` (one compound signature per batch); `shown` formats a key,
    `rule` (when given) ends the message in brackets."""
    values = [key(s) for s in samples]
    first = values[0]
    for differing, value in enumerate(values):
        if value != first:
            raise ValueError(
                f"a batch must hold one compound signature: {what} of sample {differing} is {shown(value)}, "
                f"sample 0 has {shown(first)}" + (f" ({rule})" if rule else "")
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


def fill(
    buffer: BatchBuffer, offsets: Sequence[int], fields: Sequence[_Field], checks: Sequence[MemberCheck | None]
) -> list[Mismatch]:
    """Copy every sample's part of every field into the buffer, zero-padding short prompt rows; the rows that mismatch.

    Each sample is filled as one row (`fill.py`): its tensors still in a file are read in file
    order, so the contiguous tensors of one safetensors payload arrive with one system call, and
    its member checksum is computed as they arrive.
    """
    rows: list[list[Placed]] = [[] for _ in checks]
    for field, offset in zip(fields, offsets):
        row_bytes = _field_bytes(field) // max(1, field.shape[0])
        for row, source in enumerate(field.sources):
            start = offset + row * row_bytes
            count = source.nbytes if isinstance(source, FileTensor) else source.numel() * source.element_size()
            if count < row_bytes:
                buffer.zero(start + count, start + row_bytes)
            if count:
                rows[row].append((start, source))
    return fill_rows(buffer, rows, checks)


def _batch_dict(
    samples: Sequence[Sample],
    fields: Sequence[_Field],
    tensors: Sequence[torch.Tensor],
    position: tuple[int, int] | None,
    skipped: list[SkippedSample] | None,
) -> Batch:
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
    batch_metadata: BatchMetadata = {
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
    }
    if position is not None:
        batch_metadata["position"] = list(position)
    if skipped is not None:
        batch_metadata["skipped"] = len(skipped)
        batch_metadata["skipped_samples"] = skipped
    if all("sample_index" in s for s in samples):
        batch_metadata["sample_indices"] = [int(s["sample_index"]) for s in samples]
    return {
        "image_latents": by_key["image_latents"],
        "context_latents": by_key["context_latents"],
        "text_embeddings": by_key["text_embeddings"],
        "text_attention_mask": by_key["text_attention_mask"],
        "conditioning_tensors": by_key["conditioning_tensors"],
        "data_type": "image",
        "metadata": batch_metadata,
    }


@dataclass(frozen=True)
class AssembledBatch:
    """What `ImageEditDataset.__getitems__` returns: a batch already assembled, and the samples it holds.

    `collate_image_edit` returns `batch` as it is. torch hands this object to whatever collate
    function the loader was given and documents it as the batch's list of samples, so for any
    other collate function it also indexes and iterates as sample dicts whose tensors view the
    batch's rows (`sample(row)`).
    """

    batch: Batch
    samples: Sequence[Sample]  # as opened: their tensors are not to be read once the batch is built

    def sample(self, row: int) -> Sample:
        """Sample `row` of the batch, its tensors views of that row."""
        sample, batch = self.samples[row], self.batch
        length = sample["prompt_embeddings"].shape[0]
        return {
            **sample,
            "target_latent": batch["image_latents"][row],
            "context_latents": [c[row] for c in batch["context_latents"]],
            "prompt_embeddings": batch["text_embeddings"][row, :length],
            "prompt_attention_mask": batch["text_attention_mask"][row, :length],
            "conditioning_tensors": {n: t[row] for n, t in batch["conditioning_tensors"].items()},
        }

    def __len__(self) -> int:
        return len(self.samples)

    @overload
    def __getitem__(self, row: int) -> Sample: ...
    @overload
    def __getitem__(self, row: slice) -> list[Sample]: ...
    def __getitem__(self, row: int | slice) -> Sample | list[Sample]:
        rows = range(len(self.samples))[row]
        return [self.sample(r) for r in rows] if isinstance(rows, range) else self.sample(rows)

    def __iter__(self) -> Iterator[Sample]:
        return (self.sample(row) for row in range(len(self.samples)))
