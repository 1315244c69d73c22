"""`ImageEditDataset`: a cache index plus per-sample payload loading and validation."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .batch.collate import AssembledBatch, assemble
from .contract import validate
from .contract.batch import Sample, SkippedSample
from .contract.signature import Signature
from .errors import CacheFormatError
from .index.index import CacheIndex
from .payload.corrupt import CorruptPolicy, SkipLog
from .payload.payload import OpenPayload, materialized, payload_from_bytes
from .storage.location import DEFAULT_SHARD_CACHE_BYTES, CacheLocation, RemoteRead
from .storage.prefetch import ShardPrefetcher
from .storage.reader import Opened, PayloadReader
from .storage.remote import RequestPolicy


class ImageEditDataset(Dataset):
    """Samples of a cached image-edit data set, in index order.

    `dataset[i]` loads payload `i` (weights-only), checks it against the contract, its index
    record and (packed caches) its member checksum, and returns the sample dict
    (`contract.batch.Sample`: `target_latent`, `context_latents`, `prompt_embeddings`,
    `prompt_attention_mask`, `conditioning_tensors`, `metadata`, `sample_index` = `i`).
    `require_checksums` refuses a cache whose reads no member checksum would check.
    """

    def __init__(
        self,
        cache_dir: str | Path | CacheLocation,
        quantization: int = 64,
        use_index_store: bool = True,
        on_corrupt_sample: CorruptPolicy = "raise",
        max_corrupt_fraction: float = 0.01,
        quarantine_file: str | Path | None = None,
        storage_options: Mapping[str, Any] | None = None,
        remote_read: RemoteRead = "range",
        local_cache_dir: str | None = None,
        shard_cache_bytes: int = DEFAULT_SHARD_CACHE_BYTES,
        require_checksums: bool = False,
        remote_requests: RequestPolicy | Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(quantization, bool) or not isinstance(quantization, int) or quantization <= 0:
            raise ValueError(f"quantization must be a positive integer, got {quantization!r}")
        self.location = CacheLocation.of(
            cache_dir,
            storage_options=storage_options,
            remote_read=remote_read,
            local_cache_dir=local_cache_dir,
            shard_cache_bytes=shard_cache_bytes,
            remote_requests=remote_requests,
        )
        self.cache_dir = self.location.display  # a URL stays a string: Path would fold its "//"
        self.quantization = quantization
        self.index: CacheIndex
        self.reader: PayloadReader
        self.index, self.reader = self.location.open(use_store=use_index_store)
        if require_checksums:  # refuse data whose reads no checksum checks
            refuse_unchecked(self.index, self.cache_dir)
        self.skips = SkipLog(
            on_corrupt_sample, max_corrupt_fraction, len(self.index), Path(quarantine_file) if quarantine_file else None
        )
        self._members: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> Sample:
        sample, payload = self.open_sample(self.checked_index(idx))
        with payload:  # each tensor in memory of its own, as torch.load would give it
            if payload.check is None:
                return materialized(sample)  # type: ignore[no-any-return]
            member = payload.check.verified_bytes()  # read once, checked, and the tensors copied from it
            return materialized(sample, member, payload.check.base)  # type: ignore[no-any-return]

    def __getitems__(self, indices: list[int]) -> AssembledBatch:
        """Load one batch, read straight into the batch's memory; `collate_image_edit` returns it as is.

        Under the "skip" policy broken samples are dropped (see `payload/corrupt.py`). The batch metadata
        reports what was dropped and, for batches from our sampler, `position` (epoch and step in
        the epoch plan).
        """
        opened, skipped = self.open_batch([self.checked_index(i) for i in indices])
        try:
            return assembled(
                opened,
                skipped,
                plan_position(indices),
                self.skips.policy,
                lambda row, error: self.skips.record(int(opened[row][0]["sample_index"]), error),
                partial(self.replacement_for, indices[0]),
            )
        finally:
            close_all(opened)

    def checked_index(self, idx: int) -> int:
        """`idx` as a non-negative index, or an IndexError."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample index {idx} is out of range for a cache of {len(self)} samples")
        return int(idx) % len(self)

    def open_sample(self, idx: int) -> tuple[Sample, OpenPayload]:
        """Open payload `idx` and check it against the contract and its index record (no tensor bytes read yet)."""
        return self.checked_sample(idx, self.reader.open(idx))

    def checked_sample(self, idx: int, payload: OpenPayload) -> tuple[Sample, OpenPayload]:
        """Check opened payload `idx` against the contract and its index record; closes it if it fails.

        A packed member that fails is read again whole first: a mismatch with its checksum is the
        error then; intact bytes (the first read was not) are checked again from memory.
        """
        relative = self.reader.display(idx)
        try:
            try:
                sample = validate.payload(
                    payload.fields, self.index.signature(idx), relative, self.index.source_revision
                )
            except CacheFormatError:
                if payload.check is None:
                    raise
                member = payload.check.confirmed()
                if isinstance(member, CacheFormatError):
                    raise member from None
                payload.close()
                payload = payload_from_bytes(member, relative)
                sample = validate.payload(
                    payload.fields, self.index.signature(idx), relative, self.index.source_revision
                )
        except BaseException:
            payload.close()
            raise
        sample["sample_index"] = idx
        return sample, payload  # type: ignore[return-value]  # validate.payload builds the Sample keys

    def open_each(self, indices: list[int]) -> list[Opening]:
        """Open and check a batch's samples, in order; the batch's reads run concurrently where the reader can.

        A sample that breaks the contract raises under the "raise" policy and is recorded in its
        place under "skip". Whatever was opened is closed when this raises.
        """
        payloads: list[Opened | None] = list(self.reader.open_many(indices))  # each read retried where it is made
        results: list[Opening] = []
        try:
            for position, (index, payload) in enumerate(zip(indices, payloads)):
                payloads[position] = None  # checked_sample owns it now: closes it when it fails
                try:
                    if isinstance(payload, BaseException):
                        raise payload
                    results.append(self.checked_sample(index, payload))  # type: ignore[arg-type]
                except validate.CacheFormatError as error:
                    if self.skips.policy == "raise":
                        raise
                    results.append(self.skips.record(index, error))
            return results
        except BaseException:
            close_all(results)
            for payload in payloads:
                if isinstance(payload, OpenPayload):
                    payload.close()
            raise

    def open_batch(self, indices: list[int]) -> tuple[list[tuple[Sample, OpenPayload]], list[SkippedSample] | None]:
        """Open a batch's samples under the corrupt-sample policy; also the skipped ones (None under "raise")."""
        return kept_or_replaced(self.open_each(indices), self.skips.policy, partial(self.replacement_for, indices[0]))

    def replacement_for(
        self, index: int, skipped: list[SkippedSample], damaged: Collection[int] = ()
    ) -> tuple[Sample, OpenPayload]:
        """The next loadable sample after `index` in its bucket, so a batch of bad samples still yields one.

        `damaged` are samples this batch already found damaged, which are passed over.
        """
        if self._members is None:
            self._members = self.index.bucket_members()
        members = self._members[int(self.index.bucket_ids[index])]
        start = int(np.searchsorted(members, index))
        for offset in range(1, len(members)):
            candidate = int(members[(start + offset) % len(members)])
            if candidate in damaged:
                continue
            try:
                return self.open_sample(candidate)
            except validate.CacheFormatError as error:
                skipped.append(self.skips.record(candidate, error))
        raise validate.CacheFormatError(
            self.index.relative_path(index),
            "bucket",
            "every sample of this bucket is corrupt; nothing left to train on",
        )

    def prefetcher(self, in_flight: int) -> ShardPrefetcher | None:
        """What fetches ahead of the loader for this cache's layout (see `PayloadReader.prefetcher`)."""
        return self.reader.prefetcher(in_flight)

    def close(self) -> None:
        """Close the files this dataset keeps open in this process (a packed cache's shards); it reopens them on use."""
        self.reader.close()

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


Opening = tuple[Sample, OpenPayload] | SkippedSample  # one sample of a batch: opened and checked, or skipped


def plan_position(indices: list[int]) -> tuple[int, int] | None:
    """(epoch, step) of a batch from our sampler (a `PlannedBatch` knows its place in the plan), else None."""
    step = getattr(indices, "step", None)
    return None if step is None else (int(indices.epoch), int(step))  # type: ignore[attr-defined]


def kept_or_replaced(
    results: list[Opening],
    policy: CorruptPolicy,
    replacement: Callable[[list[SkippedSample]], tuple[Sample, OpenPayload]],
) -> tuple[list[tuple[Sample, OpenPayload]], list[SkippedSample] | None]:
    """A batch's opened samples and its skipped ones (None under "raise").

    When every sample was skipped, `replacement` opens one good sample (noting further skips in
    the list it is given), so a batch always holds at least one.
    """
    opened = [result for result in results if isinstance(result, tuple)]
    if policy == "raise":
        return opened, None
    skipped: list[SkippedSample] = [result for result in results if not isinstance(result, tuple)]
    if not opened:
        opened.append(replacement(skipped))
    return opened, skipped


Replacement = Callable[[list[SkippedSample], Collection[int]], tuple[Sample, OpenPayload]]


def assembled(
    opened: list[tuple[Sample, OpenPayload]],
    skipped: list[SkippedSample] | None,
    position: tuple[int, int] | None,
    policy: CorruptPolicy,
    skip: Callable[[int, CacheFormatError], SkippedSample],
    replacement: Replacement,
    sources: list[str] | None = None,
    replacement_source: str | None = None,
) -> AssembledBatch:
    """The batch of `opened`, each packed member checked as it is read; damage confirmed by a re-read counts.

    A member whose bytes did not match its checksum is read again whole: bytes that match now take
    its place in the batch; a second mismatch is the sample's error, raised under "raise". Under
    "skip" it is recorded (`skip(row, error)`: row `row` of `opened`) and the batch is assembled
    again without it (a bucket's next good sample, from `replacement`, when none is left).
    Replacements are appended to `opened` (and `replacement_source` to `sources`), for the caller to close.
    """
    rows = list(range(len(opened)))
    damaged: set[int] = set()  # sample indices this batch found damaged
    while True:
        samples = [opened[row][0] for row in rows]
        built = assemble(
            samples,
            checks=[opened[row][1].check for row in rows],
            position=position,
            skipped=skipped,
            sources=None if sources is None else [sources[row] for row in rows],
        )
        confirmed: dict[int, CacheFormatError] = {}
        for mismatch in built.mismatches:
            member = mismatch.check.confirmed()
            if isinstance(member, CacheFormatError):
                confirmed[rows[mismatch.row]] = member
            else:
                built.patch(mismatch, member)
        if not confirmed:
            return AssembledBatch(built.batch, samples)
        built.discard()
        if policy == "raise" or skipped is None:
            raise next(iter(confirmed.values()))
        for row, error in confirmed.items():
            skipped.append(skip(row, error))
            damaged.add(int(opened[row][0]["sample_index"]))
        rows = [row for row in rows if row not in confirmed]
        if not rows:
            opened.append(replacement(skipped, damaged))
            if sources is not None:
                sources.append(replacement_source or "")
            rows = [len(opened) - 1]


def refuse_unchecked(index: CacheIndex, cache: object) -> None:
    """Refuse a cache whose reads no member checksum checks (`require_checksums`), naming it."""
    if index.member_checksum is not None:
        return
    if index.packed:
        why = "it was packed before member checksums existed; `image-edit-data cache pack` it again to add them"
    else:
        why = "it stores one file per sample, which has none; `image-edit-data cache pack` it into shards that do"
    raise ValueError(f"{cache}: require_checksums is set, but this cache has no member checksums ({why})")


def close_all(opened: Sequence[Opening]) -> None:
    """Close every opened payload file among `opened`."""
    for result in opened:
        if isinstance(result, tuple):
            result[1].close()
