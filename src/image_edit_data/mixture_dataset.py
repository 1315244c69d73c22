"""A mixture of caches: `CacheSource` (one cache and its weight) and `MixtureDataset`, their samples as one.

Sources lie end to end: sample `offsets[i] + j` is sample `j` of source `i`, and a bucket holds
the samples of every source with that compound signature, so a batch may mix sources but never
signatures. Which samples an epoch draws from each source is the sampler's (`sampling/mixture_draw.py`).
Sources that could never share a batch are refused when the mixture opens (`check_compatible`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .batch.collate import AssembledBatch
from .contract import validate
from .contract.batch import EDIT_MASK, Sample, SkippedSample
from .contract.signature import Signature, sort_key
from .dataset import ImageEditDataset, Opening, assembled, close_all, kept_or_replaced, plan_position
from .payload.payload import OpenPayload
from .storage.location import RemoteRead
from .storage.prefetch import ShardPrefetcher
from .storage.remote import RequestPolicy

UNCHECKED_CONDITIONING = frozenset({EDIT_MASK})  # a per-sample flag in the bucket key keeps masked batches apart


@dataclass
class CacheSource:
    """One cache of a mixture, with its weight; unset remote options take the loader config's."""

    cache_dir: str
    """Directory holding metadata.json, its shards and the payloads, or a URL."""
    weight: float = 1.0
    """This source's share of each epoch is `weight / sum of weights`."""
    name: str | None = None
    """Name in batch metadata, the data monitor and errors (default: the last part of `cache_dir`)."""
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # holds credentials: not shown
    """fsspec options when `cache_dir` is a URL (default: the config's `storage_options`)."""
    remote_read: RemoteRead | None = None
    """Remote packed caches: "range" or "shard_cache" (default: the config's `remote_read`)."""
    local_cache_dir: str | None = None
    """Node-local directory for this cache's remote index copy and shards (default: the config's)."""
    require_checksums: bool | None = None
    """Refuse this cache if its reads go unchecked by member checksums (default: the config's)."""
    remote_requests: RequestPolicy | None = None
    """Deadlines and attempts of this cache's remote requests (default: the config's)."""

    @property
    def display_name(self) -> str:
        """`name`, or the last part of `cache_dir`."""
        return self.name if self.name else default_name(self.cache_dir)


def default_name(cache_dir: str) -> str:
    """The last non-empty part of a path or URL (`s3://bucket/edits/` -> `edits`)."""
    parts = [p for p in str(cache_dir).replace("\\", "/").split("/") if p and not p.endswith(":")]
    return parts[-1] if parts else str(cache_dir)


def as_sources(given: Sequence[CacheSource | Mapping[str, Any]]) -> list[CacheSource]:
    """`sources` as checked `CacheSource`s (dicts come from Python callers and checkpoints): weights, distinct names."""
    if isinstance(given, str | bytes | Mapping) or not isinstance(given, Sequence) or not given:
        raise ValueError(f"sources: expected a non-empty list of caches, got {given!r:.200}")
    known = {f.name for f in fields(CacheSource)}
    sources = []
    for i, source in enumerate(given):
        if isinstance(source, Mapping):
            unknown = sorted(set(source) - known)
            if unknown or "cache_dir" not in source:
                problem = f"unknown option {unknown[0]!r}" if unknown else "cache_dir is missing"
                raise ValueError(f"sources[{i}]: {problem} (a source takes {sorted(known)})")
            source = CacheSource(**source)
        if not isinstance(source, CacheSource):
            raise ValueError(
                f"sources[{i}]: expected a cache source (a dict with cache_dir, weight, ...), got {source!r}"
            )
        weight = source.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
            raise ValueError(f"sources[{i}].weight: expected a positive number, got {weight!r}")
        sources.append(source)
    first: dict[str, int] = {}
    for i, source in enumerate(sources):
        name = source.display_name
        if name in first:
            raise ValueError(
                f"sources[{first[name]}] and sources[{i}] are both named {name!r}: give each a distinct `name`"
            )
        first[name] = i
    return sources


class MixtureDataset(Dataset):
    """The samples of several caches as one data set (`dataset[offsets[i] + j]` is sample `j` of source `i`)."""

    def __init__(self, sources: Sequence[ImageEditDataset], names: Sequence[str], weights: Sequence[float]) -> None:
        if not sources or not len(sources) == len(names) == len(weights):
            raise ValueError(f"a mixture needs one name and weight per source, got {len(names)} and {len(weights)}")
        for i, (source, name) in enumerate(zip(sources, names)):
            if len(source) == 0:
                raise ValueError(f"sources[{i}] {name!r} ({source.cache_dir}): the cache holds no samples")
        check_compatible(sources, names)
        self.sources = list(sources)
        self.names = list(names)
        self.weights = [float(w) for w in weights]
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in sources], dtype=np.int64)])  # [S + 1]
        self.signatures: tuple[Signature, ...] = tuple(
            sorted({sig for s in sources for sig in s.signatures}, key=sort_key)
        )
        self.quantization = sources[0].quantization
        self.cache_dir = ", ".join(str(s.cache_dir) for s in sources)  # for messages

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def fingerprints(self) -> tuple[str, ...]:
        """Each source's index fingerprint."""
        return tuple(s.index.fingerprint for s in self.sources)

    @property
    def unchecked(self) -> tuple[bool, ...]:
        """Per source: a packed cache without member checksums (its reads go unchecked)."""
        return tuple(s.index.unchecked for s in self.sources)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Samples per source."""
        return tuple(len(s) for s in self.sources)

    def locate(self, idx: int) -> tuple[int, int]:
        """(source, sample in that source) of mixture sample `idx` (non-negative, in range)."""
        source = int(np.searchsorted(self.offsets, idx, side="right")) - 1
        return source, idx - int(self.offsets[source])

    def checked_index(self, idx: int) -> int:
        """`idx` as a non-negative index, or an IndexError."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample index {idx} is out of range for a mixture of {len(self)} samples")
        return int(idx) % len(self)

    def bucket_members(self) -> list[np.ndarray]:
        """Per bucket (of `signatures`), the ascending mixture ids in it, source after source."""
        position = {sig: b for b, sig in enumerate(self.signatures)}
        parts: list[list[np.ndarray]] = [[] for _ in self.signatures]
        for source, offset in zip(self.sources, self.offsets):
            for sig, members in zip(source.signatures, source.index.bucket_members()):
                parts[position[sig]].append(members.astype(np.int64) + offset)
        return [np.concatenate(p) for p in parts]

    def member_shard(self) -> np.ndarray | None:
        """[N] a shard number per sample, numbered across sources, or None when no source is packed.

        A sample of an unpacked source counts as a shard of its own, so a shard-local shuffle
        still shuffles it freely.
        """
        if all(s.index.member_shard is None for s in self.sources):
            return None
        parts, next_shard = [], 0
        for source in self.sources:
            shards = source.index.member_shard
            if shards is None:
                shards = np.arange(len(source), dtype=np.int64)
            parts.append(shards.astype(np.int64) + next_shard)
            next_shard += int(shards.max()) + 1
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> Sample:
        source, local = self.locate(self.checked_index(idx))
        sample = self.sources[source][local]
        sample["sample_index"] = int(self.offsets[source]) + local
        return sample

    def __getitems__(self, indices: list[int]) -> AssembledBatch:
        """Load one batch as `ImageEditDataset.__getitems__` does; its metadata also names each sample's source."""
        opened, names, skipped = self.open_batch([self.checked_index(i) for i in indices])
        first_source, first_local = self.locate(self.checked_index(indices[0]))

        def skip(row: int, error: validate.CacheFormatError) -> SkippedSample:
            source, local = self.locate(int(opened[row][0]["sample_index"]))
            return self.in_mixture(source, self.sources[source].skips.record(local, error))  # type: ignore[no-any-return]

        def replacement(found: list[SkippedSample], damaged: Collection[int]) -> tuple[Sample, OpenPayload]:
            offset = int(self.offsets[first_source])
            return self.replacement(first_source, first_local, found, [i - offset for i in damaged])

        try:
            policy = self.sources[0].skips.policy
            return assembled(
                opened, skipped, plan_position(indices), policy, skip, replacement, names, self.names[first_source]
            )
        finally:
            close_all(opened)

    def open_batch(
        self, indices: list[int]
    ) -> tuple[list[tuple[Sample, OpenPayload]], list[str], list[SkippedSample] | None]:
        """A batch's samples opened under the corrupt-sample policy, their sources' names, and the skipped ones.

        Each source opens its share of the batch through `ImageEditDataset.open_each`, so a remote
        source fetches it concurrently, exactly as a single cache does.
        """
        located = [self.locate(index) for index in indices]
        results: list[Opening | None] = [None] * len(indices)
        try:
            for source in dict.fromkeys(source for source, _ in located):  # sources in order of first use
                positions = [p for p, (s, _) in enumerate(located) if s == source]
                opened = self.sources[source].open_each([located[p][1] for p in positions])
                for position, result in zip(positions, opened):
                    self.in_mixture(source, result[0] if isinstance(result, tuple) else result)
                    results[position] = result
        except BaseException:
            close_all([result for result in results if result is not None])
            raise
        first_source, first_local = located[0]

        def replacement(skipped: list[SkippedSample]) -> tuple[Sample, OpenPayload]:
            return self.replacement(first_source, first_local, skipped)

        policy = self.sources[0].skips.policy  # one policy for every source: the config's
        opened_samples, skipped = kept_or_replaced(results, policy, replacement)  # type: ignore[arg-type]
        kept = [source for (source, _), result in zip(located, results) if isinstance(result, tuple)]
        names = [self.names[source] for source in (kept or [first_source])]
        return opened_samples, names, skipped

    def replacement(
        self, source: int, local: int, skipped: list[SkippedSample], damaged: Collection[int] = ()
    ) -> tuple[Sample, OpenPayload]:
        """A replacement for a batch left empty: the sample after `local` in its bucket of `source`, in mixture ids."""
        found: list[SkippedSample] = []
        sample, payload = self.sources[source].replacement_for(local, found, damaged)
        skipped += [self.in_mixture(source, entry) for entry in found]
        return self.in_mixture(source, sample), payload

    def close(self) -> None:
        """Close the files every source keeps open in this process."""
        for source in self.sources:
            source.close()

    def in_mixture(self, source: int, item: Any) -> Any:
        """A source's sample or skip entry, its index renumbered as the mixture's."""
        key = "sample_index" if "sample_index" in item else "index"
        item[key] = int(self.offsets[source]) + int(item[key])
        return item

    def prefetcher(self, in_flight: int) -> MixturePrefetcher | None:
        """One prefetcher per source that has one (remote packed caches with a shard cache), or None."""
        parts = []
        for source, offset in zip(self.sources, self.offsets):
            observer = source.prefetcher(in_flight)
            if observer is not None:
                parts.append((int(offset), len(source), observer))
        return MixturePrefetcher(parts) if parts else None

    def get_bucket_info(self) -> dict[str, Any]:
        """Bucket count and sample count per compound signature over all sources."""
        sizes = [int(m.shape[0]) for m in self.bucket_members()]
        buckets = {sig.describe(): n for sig, n in zip(self.signatures, sizes)}
        return {"total_buckets": len(buckets), "buckets": buckets}


def check_compatible(sources: Sequence[ImageEditDataset], names: Sequence[str]) -> None:
    """Refuse sources whose samples could never share a batch, naming both sources and each differing field."""
    profiles = [profile(s) for s in sources]
    for i in range(1, len(sources)):
        differing = [
            f"{field}: {profiles[0][field]} vs {profiles[i][field]}"
            for field in profiles[0]
            if profiles[0][field] != profiles[i][field]
        ]
        if differing:
            raise ValueError(
                f"sources[0] {names[0]!r} ({sources[0].cache_dir}) and sources[{i}] {names[i]!r} "
                f"({sources[i].cache_dir}) cannot share batches: " + "; ".join(differing)
            )


def profile(dataset: ImageEditDataset) -> dict[str, Any]:
    """What every sample of a batch must agree on, read from the index and one sample's header."""
    channels = sorted({shape[0] for sig in dataset.signatures for shape in (sig.target, *sig.contexts)})
    sample, payload = first_loadable(dataset)
    with payload:
        return {
            "latent channels": channels,
            "latent dtype": dtype_name(sample["target_latent"].dtype),
            "prompt embedding width": int(sample["prompt_embeddings"].shape[1]),
            "prompt embedding dtype": dtype_name(sample["prompt_embeddings"].dtype),
            "prompt attention mask dtype": dtype_name(sample["prompt_attention_mask"].dtype),
            "conditioning tensors": sorted(set(sample["conditioning_tensors"]) - UNCHECKED_CONDITIONING),
        }


def first_loadable(dataset: ImageEditDataset) -> tuple[Sample, OpenPayload]:
    """The first sample of the first bucket that opens; under the "skip" policy broken ones are passed over.

    Only headers are read. Under "raise" the first sample's error stands, as it would at its first read.
    """
    errors: list[validate.CacheFormatError] = []
    for members in dataset.index.bucket_members():
        try:
            return dataset.open_sample(int(members[0]))
        except validate.CacheFormatError as error:
            if dataset.skips.policy != "skip":
                raise
            errors.append(error)
    raise errors[0]  # every bucket's first sample is broken (a source is never empty here)


def dtype_name(dtype: Any) -> str:
    """`float32` for `torch.float32`."""
    return str(dtype).removeprefix("torch.")


class MixturePrefetcher:
    """The sampler's observer for a mixture: each source's prefetcher sees the plan in its own sample ids."""

    def __init__(self, parts: list[tuple[int, int, ShardPrefetcher]]) -> None:
        self.parts = parts  # (first mixture id, samples, prefetcher) per source that has one
        self._plan: Any = None  # the mixture's plan the source plans below were made for
        self._source_plans: list[_SourcePlan] = []

    def __call__(self, sampler: Any, step: int) -> None:
        plan = sampler.plan()
        if plan is not self._plan:  # one source plan per epoch plan: a prefetcher knows its epoch by the object
            self._plan = plan
            self._source_plans = [_SourcePlan(plan, offset, size) for offset, size, _ in self.parts]
        for (_, _, prefetcher), source_plan in zip(self.parts, self._source_plans):
            prefetcher(_SourceView(sampler, source_plan), step)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plan": None, "_source_plans": []}  # plans stay in the training process

    def close(self) -> None:
        """Close every source's prefetcher."""
        for _, _, prefetcher in self.parts:
            prefetcher.close()


class _SourceView:
    """A sampler as one source's prefetcher sees it: its plan holds only that source's samples, in its ids."""

    def __init__(self, sampler: Any, source_plan: _SourcePlan) -> None:
        self.sampler, self.source_plan = sampler, source_plan
        self.segment_start = int(sampler.segment_start)

    def __len__(self) -> int:
        return len(self.sampler)

    def plan(self) -> _SourcePlan:
        return self.source_plan


@dataclass(frozen=True)
class _SourcePlan:
    """An epoch plan seen by one source: its steps, and only that source's samples in them."""

    plan: Any
    offset: int
    size: int

    def __len__(self) -> int:
        return len(self.plan)

    def step_samples(self, steps: slice) -> np.ndarray:
        """This source's samples over a range of the plan's steps, in its own ids."""
        ids = self.plan.step_samples(steps)
        return ids[(ids >= self.offset) & (ids < self.offset + self.size)] - self.offset
