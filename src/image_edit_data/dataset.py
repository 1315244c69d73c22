"""`ImageEditDataset`: a cache index plus per-sample payload loading and validation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from . import validate
from .buckets import Signature
from .corrupt import CorruptPolicy, SkipLog
from .index import CacheIndex
from .index_store import open_index
from .payload import load_payload


class ImageEditDataset(Dataset):
    """Samples of a cached image-edit data set, in index order.

    `dataset[i]` loads payload `i` (weights-only), checks it against the contract and its index
    record, and returns the sample dict: `target_latent`, `context_latents`, `prompt_embeddings`,
    `prompt_attention_mask`, `conditioning_tensors`, `metadata`, plus `sample_index` (= `i`).
    """

    def __init__(
        self,
        cache_dir: str | Path,
        quantization: int = 64,
        use_index_store: bool = True,
        on_corrupt_sample: CorruptPolicy = "raise",
        max_corrupt_fraction: float = 0.01,
        quarantine_file: str | Path | None = None,
    ) -> None:
        if isinstance(quantization, bool) or not isinstance(quantization, int) or quantization <= 0:
            raise ValueError(f"quantization must be a positive integer, got {quantization!r}")
        self.cache_dir = Path(cache_dir)
        self.quantization = quantization
        self.index: CacheIndex = open_index(cache_dir, use_store=use_index_store)
        self.skips = SkipLog(
            on_corrupt_sample, max_corrupt_fraction, len(self.index), Path(quarantine_file) if quarantine_file else None
        )
        self._members: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample index {idx} is out of range for a cache of {len(self)} samples")
        idx = int(idx) % len(self)
        relative = self.index.relative_path(idx)
        raw = load_payload(self.index.payload_path(idx), relative)
        sample = validate.payload(raw, self.index.signature(idx), relative, self.index.source_revision)
        sample["sample_index"] = idx
        return sample

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """Load one batch; under the "skip" policy broken samples are dropped (see `corrupt.py`).

        The first sample of the batch carries `skipped` (what was dropped) and, for batches from our
        sampler, `position` (epoch and step in the epoch plan), for collate to report.
        """
        samples = self.load_batch(indices)
        if hasattr(indices, "step"):
            samples[0]["position"] = [indices.epoch, indices.step]  # type: ignore[attr-defined]
        return samples

    def load_batch(self, indices: list[int]) -> list[dict[str, Any]]:
        """Load a batch's samples under the corrupt-sample policy."""
        if self.skips.policy == "raise":
            return [self[i] for i in indices]
        samples, skipped = [], []
        for index in indices:
            try:
                samples.append(self[index])
            except validate.CacheFormatError as error:
                skipped.append(self.skips.record(index, error))
        if not samples:
            samples.append(self.replacement_for(indices[0], skipped))
        samples[0]["skipped"] = skipped
        return samples

    def replacement_for(self, index: int, skipped: list[dict[str, Any]]) -> dict[str, Any]:
        """The next loadable sample after `index` in its bucket, so a batch of bad samples still yields one."""
        if self._members is None:
            self._members = self.index.bucket_members()
        members = self._members[int(self.index.bucket_ids[index])]
        start = int(np.searchsorted(members, index))
        for offset in range(1, len(members)):
            candidate = int(members[(start + offset) % len(members)])
            try:
                return self[candidate]
            except validate.CacheFormatError as error:
                skipped.append(self.skips.record(candidate, error))
        raise validate.CacheFormatError(
            self.index.relative_path(index),
            "bucket",
            "every sample of this bucket is corrupt; nothing left to train on",
        )

    @property
    def signatures(self) -> tuple[Signature, ...]:
        """Bucket id -> compound signature."""
        return self.index.signatures

    @property
    def cache_manifest(self) -> dict[str, Any]:
        """The cache's metadata.json, untouched."""
        return dict(self.index.manifest)

    def get_bucket_info(self) -> dict[str, Any]:
        """Bucket count and sample count per compound signature (`target=CxHxW/contexts=[...]`)."""
        sizes = self.index.bucket_sizes()
        buckets = {sig.describe(): int(n) for sig, n in zip(self.index.signatures, sizes)}
        return {"total_buckets": len(buckets), "buckets": buckets}


@dataclass
class ImageEditDatasetConfig:
    """Construction-time configuration for `ImageEditDataset`."""

    cache_dir: str
    """Directory holding metadata.json, its shards and the payloads."""
    quantization: int = 64
    """Pixel quantization used by the dynamic batch size."""

    def build(self) -> ImageEditDataset:
        """Open the configured cache."""
        return ImageEditDataset(cache_dir=self.cache_dir, quantization=self.quantization)
