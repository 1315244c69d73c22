"""`cache convert`: rewrite a cache's payloads in the other format, keeping its index order.

Converting a NeMo `.pt` cache to our `.safetensors` form removes pickle from the read path. Every
payload is read through the normal reader (weights-only, containment and contract checks) and
written atomically; shards and then `metadata.json` are written last, so an interrupted
conversion leaves no index, and running the same command again skips the payloads already done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..._atomic import write_text_atomic
from ...dataset import ImageEditDataset
from ...index.index import MANIFEST
from ...payload.payload import PayloadFormat, save_payload
from ..run.merge import shard_name

RECORDS_PER_SHARD = 10_000


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote."""

    samples: int
    converted: int
    reused: int
    shards: int


def converted_name(relative: str, payload_format: PayloadFormat) -> str:
    """`samples/x.pt` -> `samples/x.safetensors` (and back)."""
    stem = relative.rsplit(".", 1)[0] if relative.rsplit("/", 1)[-1].count(".") else relative
    return f"{stem}.{payload_format}"


def convert_cache(
    source: str | Path,
    destination: str | Path,
    payload_format: PayloadFormat,
    workers: int = 4,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertReport:
    """Write `source`'s samples into `destination` as `payload_format` payloads with the same index order."""
    target = Path(destination)
    if (target / MANIFEST).exists():
        raise ValueError(f"{target}: already holds a finished cache ({MANIFEST} exists); choose a new directory")
    dataset = ImageEditDataset(source)
    if Path(source).resolve() == target.resolve():
        raise ValueError(f"{target}: converting a cache into itself would overwrite it; choose a new directory")
    names = [converted_name(dataset.index.relative_path(i), payload_format) for i in range(len(dataset))]
    records: list[dict[str, object]] = [{} for _ in names]

    def convert(i: int) -> bool:
        sample = dataset[i]
        meta = sample["metadata"]
        records[i] = {
            "cache_file": names[i],
            "compound_bucket_signature": meta["compound_bucket_signature"],
            "target_token_length": meta["target_token_length"],
            "context_token_lengths": meta["context_token_lengths"],
            "text_token_length": meta["text_token_length"],
        }
        path = target / names[i]
        if path.exists():
            return False  # written atomically by an earlier run, so complete
        save_payload(path, {key: value for key, value in sample.items() if key != "sample_index"})
        return True

    reused = 0
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for done, wrote in enumerate(pool.map(convert, range(len(dataset))), start=1):
            reused += not wrote
            if on_progress is not None:
                on_progress(done, len(dataset))
    shards = write_index(dataset, target, records, payload_format)
    return ConvertReport(samples=len(dataset), converted=len(dataset) - reused, reused=reused, shards=shards)


def write_index(
    dataset: ImageEditDataset, target: Path, records: list[dict[str, object]], payload_format: PayloadFormat
) -> int:
    """Shards (records in the source's order), then the manifest with the source's provenance."""
    shard_names = []
    for number, start in enumerate(range(0, max(len(records), 1), RECORDS_PER_SHARD)):
        shard_names.append(shard_name(number))
        write_text_atomic(target / shard_names[-1], json.dumps(records[start : start + RECORDS_PER_SHARD]))
    manifest = {
        **dataset.index.manifest,
        "shards": shard_names,
        "format": payload_format,
        "converted_from": str(dataset.index.root),
    }
    write_text_atomic(target / MANIFEST, json.dumps(manifest, indent=2))
    return len(shard_names)
