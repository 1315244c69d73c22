"""One payload per encoded sample: its file name, the payload dict with its metadata, its index record."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ...contract.batch import EDIT_MASK
from ...contract.signature import Signature
from ...payload.payload import PayloadFormat, save_payload
from ..encoders.base import Truncation
from ..sources.base import SourceRecord
from .gil_gate import GilGate

StoreDtype = Literal["float32", "bfloat16", "float16"]
STORE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLES_DIR = "samples"
# atomic_writer's temporaries: `.<final name>.<random>.tmp` beside the final file.
_TEMPORARY = re.compile(r"^\.sample_(\d+)\.(pt|safetensors)\..*\.tmp$")


def payload_name(row_index: int, payload_format: PayloadFormat) -> str:
    """Path of the payload of the sample with `row_index`, relative to the cache directory."""
    return f"{SAMPLES_DIR}/sample_{row_index:08d}.{payload_format}"


def token_count(height: int, width: int, patch_size: int) -> int:
    """Transformer tokens of a latent grid cut into `patch_size` x `patch_size` patches (edges rounded up)."""
    return math.ceil(height / patch_size) * math.ceil(width / patch_size)


def shape3(latent: torch.Tensor) -> tuple[int, int, int]:
    """The `[C, H, W]` shape of a latent."""
    channels, height, width = latent.shape
    return int(channels), int(height), int(width)


@dataclass(frozen=True)
class EncodedSample:
    """A source record with its latents and prompt encoding, ready to be written."""

    source: SourceRecord
    target_latent: torch.Tensor  # [C, H, W]
    context_latents: tuple[torch.Tensor, ...]  # [C, h_i, w_i], ordered
    prompt_embeddings: torch.Tensor  # [S, D]
    prompt_attention_mask: torch.Tensor  # [S]
    original_pixel_shapes: Mapping[str, Any]  # {"target": [H, W], "contexts": [[h, w], ...]} before resizing
    conditioning: Mapping[str, torch.Tensor] = field(default_factory=dict)  # named, any shape
    prompt_truncations: tuple[Truncation, ...] = ()  # what a length limit cut from the prompt
    edit_mask: torch.Tensor | None = None  # float32 [H, W] at the target latent's size, 1 = edited


def owned(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` (cast to `dtype`) as a contiguous block of its own: a row of a batch's output is copied out, so
    saving or sending it does not carry the whole batch; a tensor that is one already is kept as it is."""
    cast = tensor if dtype is None else tensor.to(dtype)
    if cast.is_contiguous() and cast.untyped_storage().nbytes() == cast.numel() * cast.element_size():
        return cast
    return cast.clone(memory_format=torch.contiguous_format)


def assemble(
    sample: EncodedSample, payload_format: PayloadFormat, token_patch_size: int, store_dtype: StoreDtype
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The payload dict (contract layout) and the index record of one sample."""
    masked = sample.edit_mask is not None
    signature = Signature(shape3(sample.target_latent), tuple(shape3(c) for c in sample.context_latents), masked)
    target_tokens = token_count(*signature.target[1:], token_patch_size)
    context_tokens = [token_count(*c[1:], token_patch_size) for c in signature.contexts]
    text_tokens = int(sample.prompt_attention_mask.bool().sum())
    raw = sample.source.sample
    dtype = STORE_DTYPES[store_dtype]
    # Floating conditioning tensors are stored like the embeddings; integer ones (grids, ids) keep their dtype.
    conditioning = {name: owned(t, dtype if t.is_floating_point() else None) for name, t in sample.conditioning.items()}
    if sample.edit_mask is not None:  # float32 whatever the store dtype: a weight map, small beside the latents
        conditioning[EDIT_MASK] = owned(sample.edit_mask, torch.float32)
    metadata = {
        "original_ids": {"id": raw.sample_id},
        "target_spatial_shape": list(signature.target[1:]),
        "context_spatial_shapes": [list(c[1:]) for c in signature.contexts],
        "compound_bucket_signature": signature.to_json(),
        "conditioning_shapes": {name: list(t.shape) for name, t in conditioning.items()},
        "target_token_length": target_tokens,
        "context_token_lengths": context_tokens,
        "text_token_length": text_tokens,
        "row_index": sample.source.row_index,
        "manifest_metadata": dict(raw.metadata),
        "media": [dict(m) for m in sample.source.media],
        "original_pixel_shapes": dict(sample.original_pixel_shapes),
    }
    if sample.prompt_truncations:  # only on cut prompts, so other payloads keep NeMo's metadata keys
        metadata["prompt_truncation"] = [t.to_json() for t in sample.prompt_truncations]
    payload = {
        "target_latent": owned(sample.target_latent, dtype),
        "context_latents": [owned(c, dtype) for c in sample.context_latents],
        "prompt_embeddings": owned(sample.prompt_embeddings, dtype),
        "prompt_attention_mask": owned(sample.prompt_attention_mask),
        "conditioning_tensors": conditioning,
        "metadata": metadata,
    }
    record = {
        "cache_file": payload_name(sample.source.row_index, payload_format),
        "compound_bucket_signature": signature.to_json(),
        "original_id": raw.sample_id,
        "row_index": sample.source.row_index,
        "target_token_length": target_tokens,
        "context_token_lengths": context_tokens,
        "text_token_length": text_tokens,
    }
    return payload, record


def write_sample(
    root: Path,
    sample: EncodedSample,
    payload_format: PayloadFormat,
    token_patch_size: int,
    store_dtype: StoreDtype,
    gate: GilGate | None = None,
) -> dict[str, Any]:
    """Write the sample's payload atomically under `root` and return its index record. With a `gate`, the save
    (`torch.save` holds the GIL a millisecond or two copying a payload into its buffer) waits for it to open."""
    payload, record = assemble(sample, payload_format, token_patch_size, store_dtype)
    if gate is not None:
        gate.wait()
    save_payload(root / record["cache_file"], payload)
    return record


def remove_stale_temporaries(root: Path, row_indices: Container[int]) -> int:
    """Delete payload temporaries a killed run left behind for the samples of `row_indices`; return how many."""
    samples = root / SAMPLES_DIR
    if not samples.is_dir():
        return 0
    removed = 0
    for path in samples.iterdir():
        match = _TEMPORARY.match(path.name)
        # Other ranks may be writing their own temporaries right now; only this slice's are stale.
        if match and int(match.group(1)) in row_indices:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed
