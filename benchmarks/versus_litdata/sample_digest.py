"""One digest per sample over its tensors' bytes, so the side-by-side bench can show both loaders read the same data."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import xxhash

SYNTHETIC_ID = "synthetic-"  # the synthetic cache's sample ids: "synthetic-<number>"


def sample_number(original_ids: Mapping[str, Any]) -> int:
    """The number of a synthetic sample from its payload's `original_ids` ({"id": "synthetic-12"} -> 12)."""
    identifier = str(original_ids.get("id", ""))
    if not identifier.startswith(SYNTHETIC_ID) or not identifier[len(SYNTHETIC_ID) :].isdigit():
        raise ValueError(f"expected a synthetic sample id like 'synthetic-12', got {identifier!r}")
    return int(identifier[len(SYNTHETIC_ID) :])


def sample_digest(tensors: Sequence[torch.Tensor]) -> str:
    """XXH3-128 over the bytes of `tensors` in order, each with its dtype and shape (so a bf16/int16 view agrees)."""
    digest = xxhash.xxh3_128()
    for tensor in tensors:
        digest.update(f"{tensor.element_size()}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    return digest.hexdigest()


def payload_tensors(payload: Mapping[str, Any]) -> list[torch.Tensor]:
    """A payload's tensors in digest order: target, each context, prompt embeddings, attention mask."""
    contexts = list(payload["context_latents"])
    return [payload["target_latent"], *contexts, payload["prompt_embeddings"], payload["prompt_attention_mask"]]


def our_rows(batch: Mapping[str, Any]) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Per sample of one of our batches: its number and its tensors in digest order."""
    for row, sample in enumerate(batch["metadata"]["samples"]):
        tensors = [batch["image_latents"][row], *(c[row] for c in batch["context_latents"])]
        tensors += [batch["text_embeddings"][row], batch["text_attention_mask"][row]]
        yield sample_number(sample["original_ids"]), tensors
