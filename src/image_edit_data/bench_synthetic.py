"""Synthetic caches of realistic sample size, so `image-edit-data bench` runs without a real cache.

Written in the NeMo layout directly: one payload per sample under `samples/` (through
`save_payload`), JSON shards of index records, then metadata.json. Every sample has the same
shapes (one bucket); tensors hold random bf16 values so a compressing filesystem cannot shrink them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .atomic import write_text_atomic
from .buckets import Shape3, Signature
from .index import MANIFEST
from .payload import PayloadFormat, save_payload

# (latent [C, H, W] of the target and each context, prompt [S, D]); 16-channel latents at 8x downsampling,
# prompts from a 3584-wide text encoder, all bf16.
PRESETS: dict[str, tuple[Shape3, tuple[int, int]]] = {
    "small": ((16, 64, 64), (90, 3584)),  # 512 px target + one context, 90 prompt tokens: ~0.9 MB
    "large": ((16, 128, 128), (320, 3584)),  # 1024 px target + one context, 320 prompt tokens: ~3.3 MB
}
SHARD_SIZE = 1000  # records per index shard
PATCH = 2  # latent cells per transformer token side, for the token counts in the records


@dataclass(frozen=True)
class SyntheticSpec:
    """Shapes and file format of every sample of a synthetic cache."""

    latent: Shape3
    prompt: tuple[int, int]
    contexts: int = 1
    payload_format: PayloadFormat = "pt"

    @property
    def signature(self) -> Signature:
        """The one bucket every sample falls in."""
        return Signature(target=self.latent, contexts=(self.latent,) * self.contexts)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data per sample (bf16 latents and prompt, int64 mask); files add a few kB."""
        latent = self.latent[0] * self.latent[1] * self.latent[2]
        sequence, hidden = self.prompt
        return 2 * latent * (1 + self.contexts) + 2 * sequence * hidden + 8 * sequence


def parse_dims(text: str, option: str, example: str) -> tuple[int, ...]:
    """`16x64x64` -> (16, 64, 64), refusing anything but as many positive integers as `example` has."""
    parts = text.lower().split("x")
    rank = example.count("x") + 1
    if len(parts) != rank or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{option}: expected {rank} positive integers like {example}, got {text!r}")
    return tuple(int(p) for p in parts)


def synthetic_spec(
    preset: str, latent: str | None, prompt: str | None, contexts: int, payload_format: PayloadFormat
) -> SyntheticSpec:
    """A preset's shapes, with any of them overridden."""
    if preset not in PRESETS:
        raise ValueError(f"--preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    if contexts < 1:
        raise ValueError(f"--contexts: expected a positive integer, got {contexts}")
    preset_latent, preset_prompt = PRESETS[preset]
    return SyntheticSpec(
        latent=cast(Shape3, parse_dims(latent, "--latent", "16x64x64")) if latent else preset_latent,
        prompt=cast(tuple[int, int], parse_dims(prompt, "--prompt", "90x3584")) if prompt else preset_prompt,
        contexts=contexts,
        payload_format=payload_format,
    )


def write_synthetic_cache(
    root: Path,
    count: int,
    spec: SyntheticSpec,
    seed: int = 0,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda steps: steps,
) -> Path:
    """Write `count` samples of `spec` as a cache under `root` (which must be empty) and return `root`."""
    if count < 1:
        raise ValueError(f"--make-synthetic: expected a positive sample count, got {count}")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root}: not an empty directory; to bench a cache already there, pass it as CACHE_DIR")
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(spec.latent, generator=generator).to(torch.bfloat16)
    contexts = [torch.randn(spec.latent, generator=generator).to(torch.bfloat16) for _ in range(spec.contexts)]
    embeddings = torch.randn(spec.prompt, generator=generator).to(torch.bfloat16)
    mask = torch.ones(spec.prompt[0], dtype=torch.long)
    records = []
    for i in progress(range(count)):
        target[0, 0, 0] = i  # samples differ, at no cost per sample
        relative = f"samples/sample_{i:08d}.{spec.payload_format}"
        payload, record = sample_payload(i, spec, relative)
        payload.update(target_latent=target, context_latents=contexts, prompt_embeddings=embeddings)
        payload["prompt_attention_mask"] = mask
        save_payload(root / relative, payload)
        records.append(record)
    names = []
    for number, start in enumerate(range(0, count, SHARD_SIZE)):
        names.append(f"metadata_shard_{number:04d}.json")
        lines = ",\n".join(json.dumps(r) for r in records[start : start + SHARD_SIZE])
        write_text_atomic(root / names[-1], f"[\n{lines}\n]\n")
    manifest = {"shards": names, "dataset_name": "synthetic", "synthetic": {**asdict(spec), "samples": count}}
    write_text_atomic(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return root


def sample_payload(i: int, spec: SyntheticSpec, relative: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Payload fields other than the tensors, and the index record, of sample `i`."""
    sig = spec.signature
    target_tokens = (sig.target[1] // PATCH) * (sig.target[2] // PATCH)
    context_tokens = [(c[1] // PATCH) * (c[2] // PATCH) for c in sig.contexts]
    counts = {
        "target_token_length": target_tokens,
        "context_token_lengths": context_tokens,
        "text_token_length": spec.prompt[0],
    }
    metadata = {
        "original_ids": {"id": f"synthetic-{i}"},
        "target_spatial_shape": list(sig.target[1:]),
        "context_spatial_shapes": [list(c[1:]) for c in sig.contexts],
        "compound_bucket_signature": sig.to_json(),
        "conditioning_shapes": {},
        **counts,
    }
    record = {"cache_file": relative, "compound_bucket_signature": sig.to_json(), "row_index": i, **counts}
    return {"conditioning_tensors": {}, "metadata": metadata}, record
