"""Synthetic caches for `image-edit-data bench`, written in the NeMo layout directly.

Three kinds: payloads of realistic size (one bucket, random bf16 values so a compressing
filesystem cannot shrink them); an index only, for open time and memory at millions of records;
and many records whose payloads are hard links to one tiny file, for worker memory over an epoch.
Records carry the fields a real cache's records do.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from .._atomic import write_text_atomic
from ..contract.signature import Shape3, Signature
from ..index.index import MANIFEST
from ..payload.payload import PayloadFormat, save_payload

Progress = Callable[[Iterable[int]], Iterable[int]]
# (latent [C, H, W] of the target and each context, prompt [S, D]); 16-channel latents at 8x downsampling,
# prompts from a 3584-wide text encoder, all bf16.
PRESETS: dict[str, tuple[Shape3, tuple[int, int]]] = {
    "small": ((16, 64, 64), (90, 3584)),  # 512 px target + one context, 90 prompt tokens: ~0.9 MB
    "large": ((16, 128, 128), (320, 3584)),  # 1024 px target + one context, 320 prompt tokens: ~3.3 MB
}
# The buckets of an index-only cache: square, landscape and portrait targets, one or two contexts.
INDEX_ONLY_SIGNATURES = (
    Signature((16, 64, 64), ((16, 64, 64),)),
    Signature((16, 128, 128), ((16, 128, 128),)),
    Signature((16, 96, 128), ((16, 96, 128),)),
    Signature((16, 128, 96), ((16, 128, 96), (16, 64, 64))),
)
TINY = ((4, 8, 8), (8, 16))  # the one payload every record of a hard-link cache points at: ~4 kB
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


def _parse_dims(text: str, option: str, example: str) -> tuple[int, ...]:
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
        latent=cast(Shape3, _parse_dims(latent, "--latent", "16x64x64")) if latent else preset_latent,
        prompt=cast(tuple[int, int], _parse_dims(prompt, "--prompt", "90x3584")) if prompt else preset_prompt,
        contexts=contexts,
        payload_format=payload_format,
    )


def _check_target(root: Path, count: int, option: str) -> None:
    """Refuse a non-positive count or a directory that already holds something."""
    if count < 1:
        raise ValueError(f"{option}: expected a positive sample count, got {count}")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root}: not an empty directory; to bench a cache already there, pass it as CACHE_DIR")


def write_synthetic_cache(
    root: Path, count: int, spec: SyntheticSpec, seed: int = 0, progress: Progress = iter
) -> Path:
    """Write `count` samples of `spec` as a cache under `root` (which must be empty) and return `root`."""
    _check_target(root, count, "--make-synthetic")
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(spec.latent, generator=generator).to(torch.bfloat16)
    contexts = [torch.randn(spec.latent, generator=generator).to(torch.bfloat16) for _ in range(spec.contexts)]
    embeddings = torch.randn(spec.prompt, generator=generator).to(torch.bfloat16)
    mask = torch.ones(spec.prompt[0], dtype=torch.long)

    def records() -> Iterator[dict[str, Any]]:
        for i in progress(range(count)):
            target[0, 0, 0] = i  # samples differ, at no cost per sample
            relative = f"samples/sample_{i:08d}.{spec.payload_format}"
            tensors = {"target_latent": target, "context_latents": contexts, "prompt_embeddings": embeddings}
            save_payload(root / relative, {**tensors, **_payload_fields(i, spec), "prompt_attention_mask": mask})
            yield record(i, relative, spec.signature, spec.prompt[0])

    write_index(root, records(), {"synthetic": {**asdict(spec), "samples": count}})
    return root


def write_index_only_cache(root: Path, count: int, payload_format: PayloadFormat, progress: Progress = iter) -> Path:
    """Write metadata.json and shards of `count` records over a few buckets, and no payloads."""
    _check_target(root, count, "--make-synthetic")
    rng = np.random.default_rng(0)
    buckets = rng.integers(len(INDEX_ONLY_SIGNATURES), size=count)
    prompt_lengths = rng.integers(16, 320, size=count)
    records = (
        record(i, f"samples/sample_{i:08d}.{payload_format}", INDEX_ONLY_SIGNATURES[buckets[i]], int(prompt_lengths[i]))
        for i in progress(range(count))
    )
    write_index(root, records, {"synthetic": {"index_only": True, "samples": count}})
    return root


def write_hardlink_cache(root: Path, count: int, progress: Progress = iter) -> Path:
    """Write one tiny `.pt` payload and `count` records, each naming its own hard link to it (or to a copy)."""
    _check_target(root, count, "--worker-memory-index")
    spec = SyntheticSpec(latent=TINY[0], prompt=TINY[1])
    first = root / "samples" / "sample_00000000.pt"
    payload = {
        "target_latent": torch.zeros(spec.latent, dtype=torch.bfloat16),
        "context_latents": [torch.zeros(spec.latent, dtype=torch.bfloat16)],
        "prompt_embeddings": torch.zeros(spec.prompt, dtype=torch.bfloat16),
        "prompt_attention_mask": torch.ones(spec.prompt[0], dtype=torch.long),
        **_payload_fields(0, spec),
    }
    save_payload(first, payload)

    def records() -> Iterator[dict[str, Any]]:
        source = first
        for i in progress(range(count)):
            relative = f"samples/sample_{i:08d}.pt"
            try:
                if i:
                    # A directory entry of its own (readers refuse a payload named twice), without its bytes.
                    os.link(source, root / relative)
            except OSError as error:
                if error.errno != errno.EMLINK:
                    raise
                source = root / relative  # the filesystem's links-per-file limit (65000 on ext4): a new copy
                save_payload(source, payload)
            yield record(i, relative, spec.signature, spec.prompt[0])

    write_index(root, records(), {"synthetic": {"hard_links_to_one_payload": True, "samples": count}})
    return root


def _token_counts(sig: Signature, text_tokens: int) -> dict[str, Any]:
    """The token counts a record and its payload's metadata carry."""
    return {
        "target_token_length": (sig.target[1] // PATCH) * (sig.target[2] // PATCH),
        "context_token_lengths": [(c[1] // PATCH) * (c[2] // PATCH) for c in sig.contexts],
        "text_token_length": text_tokens,
    }


def record(i: int, relative: str, sig: Signature, text_tokens: int) -> dict[str, Any]:
    """The index record of sample `i`, with the fields a real cache's records have."""
    return {
        "cache_file": relative,
        "compound_bucket_signature": sig.to_json(),
        "original_id": f"synthetic-{i}",
        "row_index": i,
        **_token_counts(sig, text_tokens),
    }


def _payload_fields(i: int, spec: SyntheticSpec) -> dict[str, Any]:
    """Payload fields other than the tensors, for sample `i`."""
    sig = spec.signature
    metadata = {
        "original_ids": {"id": f"synthetic-{i}"},
        "target_spatial_shape": list(sig.target[1:]),
        "context_spatial_shapes": [list(c[1:]) for c in sig.contexts],
        "compound_bucket_signature": sig.to_json(),
        "conditioning_shapes": {},
        **_token_counts(sig, spec.prompt[0]),
    }
    return {"conditioning_tensors": {}, "metadata": metadata}


def write_index(root: Path, records: Iterable[dict[str, Any]], provenance: dict[str, Any]) -> None:
    """Shards of SHARD_SIZE records as they come (nothing held for the whole cache), then metadata.json."""
    root.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    shard: list[str] = []
    for item in records:
        shard.append(json.dumps(item))
        if len(shard) == SHARD_SIZE:
            names.append(write_shard(root, len(names), shard))
            shard = []
    if shard:
        names.append(write_shard(root, len(names), shard))
    manifest = {"shards": names, "dataset_name": "synthetic", **provenance}
    write_text_atomic(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def write_shard(root: Path, number: int, lines: list[str]) -> str:
    """Write shard `number` and return its name."""
    name = f"metadata_shard_{number:04d}.json"
    write_text_atomic(root / name, "[\n" + ",\n".join(lines) + "\n]\n")
    return name
