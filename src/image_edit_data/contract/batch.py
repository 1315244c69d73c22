"""The batch contract: the keys of a sample, a batch and a batch's metadata, defined once.

Samples and batches stay plain dicts at run time (models index them by key); these TypedDicts name
the keys and types for the code, the tests and the docs. Inside the loader a sample's tensors may
still be unread `FileTensor`s until collate copies them into the batch.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import torch

EDIT_MASK = "edit_mask"
"""The conditioning tensor of an edit-region mask: float32 `[H, W]` at the target latent's size, 1 = edited, in
[0, 1]; a batch holds it as `[B, H, W]`. A sample with one has a masked signature (`Signature.mask`)."""


class _SampleKeys(TypedDict):
    target_latent: torch.Tensor  # [C, H, W]
    context_latents: list[torch.Tensor]  # one [C, h, w] per context position; empty for a text-to-image row
    prompt_embeddings: torch.Tensor  # [S, D]
    prompt_attention_mask: torch.Tensor  # [S], bool or integer
    conditioning_tensors: dict[str, torch.Tensor]  # EDIT_MASK [H, W] among them when the sample has a mask
    metadata: dict[str, Any]  # the payload's metadata, token lengths filled in


class Sample(_SampleKeys, total=False):
    """One sample, `dataset[i]`."""

    sample_index: int  # its index in the dataset; set by `ImageEditDataset`


class SkippedSample(TypedDict):
    """A corrupt sample dropped from its batch under `on_corrupt_sample="skip"`."""

    index: int
    file: str
    field: str
    reason: str


class _BatchMetadataKeys(TypedDict):
    samples: list[dict[str, Any]]  # each sample's metadata
    batch_size: int
    target_token_counts: list[int]  # per sample
    context_token_counts: list[int]  # per sample, summed over its contexts
    text_token_counts: list[int]
    total_token_counts: list[int]
    target_token_count: int  # sums over the batch, plain ints
    context_token_count: int
    text_token_count: int
    total_token_count: int


class BatchMetadata(_BatchMetadataKeys, total=False):
    """`batch["metadata"]`: token counts always; the rest when the batch came through the dataset."""

    sample_indices: list[int]  # when every sample has a `sample_index`
    position: list[int]  # [epoch, step in the epoch plan], for batches from our sampler
    skipped: int  # under the "skip" policy, even when 0
    skipped_samples: list[SkippedSample]


class Batch(TypedDict):
    """One bucket's samples collated: what `collate_image_edit` returns and a training step receives."""

    image_latents: torch.Tensor  # [B, C, H, W]
    context_latents: list[torch.Tensor]  # one [B, C, h, w] per context position; empty for text-to-image rows
    text_embeddings: torch.Tensor  # [B, S_max, D], zero-padded
    text_attention_mask: torch.Tensor  # [B, S_max], zero-padded
    conditioning_tensors: dict[str, torch.Tensor]  # name -> [B, ...]; EDIT_MASK [B, H, W] in masked batches
    data_type: Literal["image"]
    metadata: BatchMetadata


__all__ = ["EDIT_MASK", "Batch", "BatchMetadata", "Sample", "SkippedSample"]
