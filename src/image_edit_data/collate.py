"""Stack one bucket's samples into a batch: latents stacked, prompts zero-padded, tokens counted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info


def collate_image_edit(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples of one compound signature into the batch contract of the cache format."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    skipped = [entry for s in samples for entry in s.get("skipped", ())]
    first = samples[0]
    check_same(samples, lambda s: (s["target_latent"].shape, s["target_latent"].dtype), "target_latent shape/dtype")
    check_same(
        samples,
        lambda s: tuple((c.shape, c.dtype) for c in s["context_latents"]),
        "ordered context_latents shapes/dtypes",
    )
    check_same(
        samples, lambda s: (s["prompt_embeddings"].shape[1], s["prompt_embeddings"].dtype), "prompt hidden size/dtype"
    )
    check_same(samples, lambda s: s["prompt_attention_mask"].dtype, "prompt_attention_mask dtype")
    embeddings, mask = pad_prompts(samples)
    metadata = [s["metadata"] for s in samples]
    target_tokens = [int(m["target_token_length"]) for m in metadata]
    context_tokens = [int(sum(m["context_token_lengths"])) for m in metadata]
    text_tokens = [int(m["text_token_length"]) for m in metadata]
    total_tokens = [t + c + x for t, c, x in zip(target_tokens, context_tokens, text_tokens)]
    batch: dict[str, Any] = {
        "image_latents": stack([s["target_latent"] for s in samples]),
        "context_latents": [
            stack([s["context_latents"][i] for s in samples]) for i in range(len(first["context_latents"]))
        ],
        "text_embeddings": embeddings,
        "text_attention_mask": mask,
        "conditioning_tensors": stack_conditioning(samples),
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
    if "position" in first:
        batch["metadata"]["position"] = list(first["position"])
    if skipped or "skipped" in first:
        batch["metadata"]["skipped"] = len(skipped)
        batch["metadata"]["skipped_samples"] = skipped
    if all("sample_index" in s for s in samples):
        batch["metadata"]["sample_indices"] = [int(s["sample_index"]) for s in samples]
    return batch


def check_same(samples: Sequence[dict[str, Any]], key: Any, what: str) -> None:
    """Refuse a batch whose samples disagree on `key` (one compound signature per batch)."""
    values = [key(s) for s in samples]
    if any(v != values[0] for v in values[1:]):
        differing = next(i for i, v in enumerate(values) if v != values[0])
        raise ValueError(
            f"a batch must hold one compound signature: {what} of sample {differing} is {values[differing]}, "
            f"sample 0 has {values[0]}"
        )


def pad_prompts(samples: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad prompt embeddings `[S_i, D]` and masks `[S_i]` to the longest `S` of the batch."""
    longest = max(s["prompt_embeddings"].shape[0] for s in samples)
    first_embedding = samples[0]["prompt_embeddings"]
    embeddings = allocate((len(samples), longest, first_embedding.shape[1]), first_embedding.dtype)
    mask = allocate((len(samples), longest), samples[0]["prompt_attention_mask"].dtype)
    for row, sample in enumerate(samples):
        length = sample["prompt_embeddings"].shape[0]
        embeddings[row, :length] = sample["prompt_embeddings"]
        embeddings[row, length:] = 0
        mask[row, :length] = sample["prompt_attention_mask"]
        mask[row, length:] = 0
    return embeddings, mask


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised batch tensor; in a loader worker, directly in shared memory.

    A worker hands its batch to the training process through shared memory. Allocating it there
    up front means the payload bytes are copied once (file pages -> batch) instead of once more
    when the batch is sent.
    """
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for size in shape:
        numel *= size
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.stack` into a tensor from `allocate`."""
    out = allocate((len(tensors), *tensors[0].shape), tensors[0].dtype)
    return torch.stack(list(tensors), out=out)


def stack_conditioning(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack named conditioning tensors; every sample must have the same names, shapes and dtypes."""
    names = set(samples[0]["conditioning_tensors"])
    for i, sample in enumerate(samples[1:], start=1):
        if set(sample["conditioning_tensors"]) != names:
            raise ValueError(
                f"conditioning_tensors names differ within a batch: sample {i} has "
                f"{sorted(sample['conditioning_tensors'])}, sample 0 has {sorted(names)}"
            )
    stacked = {}
    for name in sorted(names):
        check_same(
            samples,
            lambda s, n=name: (tuple(s["conditioning_tensors"][n].shape), s["conditioning_tensors"][n].dtype),
            f"conditioning tensor {name!r} shape/dtype",
        )
        stacked[name] = stack([s["conditioning_tensors"][name] for s in samples])
    return stacked
