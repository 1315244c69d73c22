"""Write small caches in the NeMo Automodel layout straight from JSON and torch.save.

Deliberately independent of the package's own writer, so reader tests check the contract.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from image_edit_data.payload.payload import save_payload

Shape = tuple[int, int, int]
DEFAULT_BUCKETS: tuple[tuple[Shape, tuple[Shape, ...]], ...] = (
    ((4, 8, 8), ((4, 8, 8),)),
    ((4, 8, 12), ((4, 8, 12),)),
    ((4, 12, 8), ((4, 12, 8), (4, 8, 8))),
)


def make_payload(
    index: int,
    target: Shape = (4, 8, 8),
    contexts: Sequence[Shape] = ((4, 8, 8),),
    sequence: int = 5,
    hidden: int = 6,
    conditioning: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """A valid payload whose target latent is filled with `index` (so batches reveal their samples)."""
    conditioning = conditioning or {}
    return {
        "target_latent": torch.full(target, float(index)),
        "context_latents": [torch.full(c, float(index) + 0.5) for c in contexts],
        "prompt_embeddings": torch.randn(sequence, hidden, generator=torch.Generator().manual_seed(index)),
        "prompt_attention_mask": torch.ones(sequence, dtype=torch.long),
        "conditioning_tensors": conditioning,
        "metadata": {
            "original_ids": {"id": f"s{index}"},
            "target_spatial_shape": list(target[1:]),
            "context_spatial_shapes": [list(c[1:]) for c in contexts],
            "compound_bucket_signature": {"target": list(target), "contexts": [list(c) for c in contexts]},
            "conditioning_shapes": {k: list(v.shape) for k, v in conditioning.items()},
        },
    }


def record_for(path: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The index record the reference writes for a payload."""
    metadata = payload.get("metadata")
    signature = metadata.get("compound_bucket_signature") if isinstance(metadata, dict) else None
    return {"cache_file": path, "compound_bucket_signature": signature}


def write_cache(
    root: Path,
    payloads: Sequence[dict[str, Any]],
    *,
    shards: int = 1,
    suffix: str = ".pt",
    edit_record: Callable[[int, dict[str, Any]], None] | None = None,
) -> Path:
    """Write `payloads` as a cache under `root` and return `root`."""
    (root / "samples").mkdir(parents=True, exist_ok=True)
    records = []
    for i, payload in enumerate(payloads):
        relative = f"samples/sample_{i:08d}{suffix}"
        if suffix == ".pt":
            torch.save(payload, root / relative)
        else:
            save_payload(root / relative, payload)
        record = record_for(relative, payload)
        if edit_record is not None:
            edit_record(i, record)
        records.append(record)
    names = []
    for s in range(shards):
        name = f"metadata_shard_{s:04d}.json"
        (root / name).write_text(json.dumps(records[s::shards]))
        names.append(name)
    (root / "metadata.json").write_text(json.dumps({"shards": names, "dataset_name": "tiny"}))
    return root


def tiny_cache(
    root: Path,
    counts: Sequence[int] = (5, 4, 3),
    buckets: Sequence[tuple[Shape, tuple[Shape, ...]]] = DEFAULT_BUCKETS,
    suffix: str = ".pt",
    shards: int = 1,
) -> Path:
    """A cache with `counts[b]` samples of bucket `b`, sample ids interleaved across buckets."""
    plan = [b for b, n in enumerate(counts) for _ in range(n)]
    plan = plan[::2] + plan[1::2]  # buckets mixed in index order
    payloads = [
        make_payload(i, target=buckets[b][0], contexts=buckets[b][1], sequence=3 + i % 4) for i, b in enumerate(plan)
    ]
    return write_cache(root, payloads, suffix=suffix, shards=shards)


def same_samples(a: Any, b: Any) -> None:
    """Assert two datasets hold equal samples in the same order: tensors (values and dtypes) and metadata."""
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        for key in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
            assert torch.equal(x[key], y[key]) and x[key].dtype == y[key].dtype, key
        assert all(torch.equal(p, q) for p, q in zip(x["context_latents"], y["context_latents"]))
        assert x["metadata"] == y["metadata"]
