"""`cache pack`: rewrite any cache into uncompressed tar shards of `<id>.safetensors` members, grouped by bucket.

Each shard holds samples of one bucket only, in index order, filled up to `shard_bytes`. The new
index keeps the source's samples in the source's order and records per sample `(shard, offset,
length)` and the XXH3-64 checksum of the member's bytes; the manifest lists every shard with its
size and SHA-256 (see index/packed.py). So training reads a sample with one seek and checks it,
and any tar tool can list or extract a shard. Each shard is read back once written: every member's
bytes in the file must hash to the checksum of the bytes meant for it, or the pack stops.

Like `cache convert`, packing is atomic and resumable: a shard is written to a temporary file and
renamed into place, then journalled in `progress/pack.jsonl`; rerunning the same command skips
the journalled shards, and the index (shards, then `metadata.json`) is written last. A URL
destination is packed in a local staging directory and each finished shard is uploaded as one
object (objects appear whole or not at all); `metadata.json` is uploaded last.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..._atomic import atomic_writer, write_text_atomic
from ...dataset import ImageEditDataset
from ...index.index import MANIFEST
from ...index.packed import (
    CHECKSUM,
    CHECKSUM_KEY,
    LAYOUT,
    LAYOUT_KEY,
    SHARD_CHECKSUM,
    SHARDS_KEY,
    ShardInfo,
    check_member_bytes,
    checksum_text,
    member_checksum,
)
from ...payload.payload import to_safetensors
from ...storage.location import CacheLocation
from ...storage.mirror import local_dir_for
from ...storage.remote import RemoteStore
from ..run.journal import settings_differences
from ..run.merge import shard_name
from .convert import RECORDS_PER_SHARD, converted_name

DEFAULT_SHARD_BYTES = 256 << 20
# Shards reach the file in writes of this size, not the 8 KiB pieces Python's default buffer passes
# on: the page cache then holds them in large folios, and training on the node that packed reads a
# 0.9 MB member from there in 36-41 us instead of 76-89 (`benchmarks/write_pattern.py`).
WRITE_BYTES = 8 << 20
PROGRESS = "progress"
JOURNAL = "pack.jsonl"
SETTINGS = "pack-settings.json"
PACK_VERSION = 2  # 2: member checksums (a pack journalled by version 1 has none, so it cannot be finished)
FIELDS = ("target_latent", "context_latents", "prompt_embeddings", "prompt_attention_mask", "metadata")


@dataclass(frozen=True)
class PackReport:
    """What a pack run wrote."""

    samples: int
    shards: int
    packed: int  # samples written by this run
    reused: int  # samples in shards an earlier run finished
    bytes: int  # total shard bytes


def shard_path(number: int, bucket: int) -> str:
    """Relative path of tar shard `number` (its bucket in the name, for people listing the directory)."""
    return f"shards/b{bucket:04d}-{number:06d}.tar"


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Finished shards, in order (a torn last line from a kill is ignored)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    return [json.loads(line) for line in lines]


def append_journal(path: Path, entry: Mapping[str, Any]) -> None:
    """Append one finished shard and fsync."""
    with path.open("ab") as stream:
        stream.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
        stream.flush()
        os.fsync(stream.fileno())


def claim(work: Path, settings: dict[str, Any]) -> None:
    """Record the settings of a new pack, or refuse a rerun whose settings differ."""
    path = work / PROGRESS / SETTINGS
    if path.is_file():
        differences = settings_differences(json.loads(path.read_text(encoding="utf-8")), settings)
        if differences:
            raise ValueError(
                f"{work}: this pack was started with different settings; use a new directory or the old settings:\n  "
                + "\n  ".join(differences)
            )
        return
    write_text_atomic(path, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def tar_member(name: str, data: bytes) -> tarfile.TarInfo:
    """A reproducible member header (no times, owners or modes taken from this machine)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
    return info


def canonical(data: bytes) -> bytes:
    """A safetensors file with its header's keys sorted, so packing the same sample twice gives the same bytes.

    The safetensors writer orders header keys as a hash map does, differently from call to call;
    sorting keeps the header's length (it is padded with spaces), so no tensor moves.
    """
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(text) > length:
        return data
    return data[:8] + text.ljust(length, b" ") + data[8 + length :]


def file_digests(path: Path) -> dict[str, str]:
    """A shard's manifest hashes, SHA-256 and XXH3-128, from one read in 8 MiB pieces."""
    digests: dict[str, Any] = {"sha256": hashlib.sha256(), SHARD_CHECKSUM: xxhash.xxh3_128()}
    with path.open("rb") as stream:
        while piece := stream.read(8 << 20):
            for digest in digests.values():
                digest.update(piece)
    return {field: digest.hexdigest() for field, digest in digests.items()}


def verify_written(path: Path, members: list[dict[str, Any]], names: list[str]) -> None:
    """Check each member's bytes in a written shard against the checksum of the bytes meant for it."""
    with path.open("rb") as stream:
        for member in members:
            data = os.pread(stream.fileno(), member["length"], member["offset"])
            display = f"{path}[{names[member['position']]}]"
            check_member_bytes(data, int(member[CHECKSUM], 16), display, "as written by this pack")


class Packer:
    """One pack run: the source's samples, bucket by bucket, into shards under `work`."""

    def __init__(self, dataset: ImageEditDataset, work: Path, shard_bytes: int) -> None:
        self.dataset = dataset
        self.work = work
        self.shard_bytes = shard_bytes
        index = dataset.index
        self.names = [converted_name(index.relative_path(i), "safetensors") for i in range(len(index))]
        seen: dict[str, int] = {}
        for i, name in enumerate(self.names):
            if name in seen:
                raise ValueError(
                    f"{index.relative_path(i)}: cache_file: packs to member {name!r}, as sample {seen[name]} does; "
                    "rename one of them"
                )
            seen[name] = i
        self.order = [int(i) for members in index.bucket_members() for i in members]  # bucket by bucket
        self.records: list[dict[str, Any] | None] = [None] * len(index)

    def encoded(self, start: int) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
        """(position, safetensors bytes, index record) of each sample from `order[start]` on."""
        for position in self.order[start:]:
            sample = self.dataset[position]
            meta = sample["metadata"]
            record = {
                "cache_file": self.names[position],
                "compound_bucket_signature": meta["compound_bucket_signature"],
                "target_token_length": meta["target_token_length"],
                "context_token_lengths": meta["context_token_lengths"],
                "text_token_length": meta["text_token_length"],
            }
            kept = (*FIELDS, "conditioning_tensors")
            data = to_safetensors({key: value for key, value in sample.items() if key in kept})
            yield position, canonical(data), record

    def write_shard(self, number: int, bucket: int, members: list[tuple[int, bytes, dict[str, Any]]]) -> dict[str, Any]:
        """Write one shard atomically and return its journal entry (location of every member)."""
        relative = shard_path(number, bucket)
        target = self.work / relative
        placed = []
        with (
            atomic_writer(target, buffering=WRITE_BYTES) as stream,
            tarfile.TarFile(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT, copybufsize=WRITE_BYTES) as tar,
        ):
            for position, data, record in members:
                tar.addfile(tar_member(self.names[position], data), io.BytesIO(data))
                # addfile leaves `offset` after the member's data, padded to 512-byte blocks.
                offset = tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                checksum = checksum_text(member_checksum(data))
                placed.append(
                    {"position": position, "offset": offset, "length": len(data), CHECKSUM: checksum, "record": record}
                )
        verify_written(target, placed, self.names)
        return {
            "shard": number,
            "path": relative,
            "bytes": target.stat().st_size,
            **file_digests(target),
            "members": placed,
        }

    def run(self, on_progress: Callable[[int, int], None] | None = None) -> tuple[list[dict[str, Any]], int]:
        """Write every shard not journalled yet; return all journal entries and the samples packed now."""
        journal = self.work / PROGRESS / JOURNAL
        entries = read_journal(journal)
        start = sum(len(e["members"]) for e in entries)
        bucket_of = self.dataset.index.bucket_ids
        pending: list[tuple[int, bytes, dict[str, Any]]] = []
        size = 0

        def flush() -> None:
            nonlocal pending, size
            entry = self.write_shard(len(entries), int(bucket_of[pending[0][0]]), pending)
            append_journal(journal, entry)
            entries.append(entry)
            pending, size = [], 0

        done = start
        for position, data, record in self.encoded(start):
            cost = tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            if pending and (bucket_of[pending[0][0]] != bucket_of[position] or size + cost > self.shard_bytes):
                flush()
            pending.append((position, data, record))
            size += cost
            done += 1
            if on_progress is not None:
                on_progress(done, len(self.order))
        if pending:
            flush()
        return entries, len(self.order) - start


def index_files(dataset: ImageEditDataset, entries: list[dict[str, Any]], source: str) -> list[tuple[str, bytes]]:
    """The packed cache's index: (relative path, bytes) of each JSON shard, then metadata.json."""
    records: list[dict[str, Any] | None] = [None] * len(dataset)
    shards = []
    for entry in entries:
        shards.append(ShardInfo(entry["path"], int(entry["bytes"]), entry["sha256"], entry.get(SHARD_CHECKSUM)))
        for member in entry["members"]:
            records[member["position"]] = {
                **member["record"],
                "shard": entry["shard"],
                "offset": member["offset"],
                "length": member["length"],
                CHECKSUM: member[CHECKSUM],
            }
    files = []
    names = []
    for number, start in enumerate(range(0, max(len(records), 1), RECORDS_PER_SHARD)):
        names.append(shard_name(number))
        files.append((names[-1], json.dumps(records[start : start + RECORDS_PER_SHARD]).encode()))
    manifest = {
        **dataset.index.manifest,
        "shards": names,
        "format": "safetensors",
        LAYOUT_KEY: LAYOUT,
        SHARDS_KEY: [s.to_json() for s in shards],
        CHECKSUM_KEY: CHECKSUM,
        "packed_from": source,
    }
    files.append((MANIFEST, json.dumps(manifest, indent=2).encode()))
    return files


def pack_cache(
    source: str | Path,
    destination: str,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PackReport:
    """Pack `source` (a local or remote cache of either payload format) into `destination` (a directory or URL)."""
    if shard_bytes < 4096:
        raise ValueError(f"shard_bytes must be at least 4096, got {shard_bytes}")
    target = CacheLocation.of(destination, storage_options=storage_options)
    origin = CacheLocation.of(source, storage_options=storage_options)
    store = None if target.is_local else RemoteStore(destination, dict(target.storage_options))
    if store is not None and store.exists(MANIFEST):
        raise ValueError(f"{destination}: already holds a finished cache ({MANIFEST} exists); choose a new location")
    if target.local_path is not None:
        work = target.local_path
    else:
        work = Path(staging_dir) if staging_dir else local_dir_for(store, None) / "pack-staging"  # type: ignore[arg-type]
    if (work / MANIFEST).exists():
        raise ValueError(f"{work}: already holds a finished cache ({MANIFEST} exists); choose a new directory")
    dataset = ImageEditDataset(origin)
    if (
        origin.local_path is not None
        and target.local_path is not None
        and work.resolve() == origin.local_path.resolve()
    ):
        raise ValueError(f"{destination}: packing a cache into itself would overwrite it; choose a new directory")
    claim(work, {"version": PACK_VERSION, "source": dataset.index.fingerprint, "shard_bytes": shard_bytes})
    entries, packed = Packer(dataset, work, shard_bytes).run(on_progress)
    files = index_files(dataset, entries, str(source))
    if store is None:
        for name, data in files:  # metadata.json comes last: a cache exists only once it is complete
            write_text_atomic(work / name, data.decode())
    else:
        upload(store, work, entries, files)
    return PackReport(
        samples=len(dataset),
        shards=len(entries),
        packed=packed,
        reused=len(dataset) - packed,
        bytes=sum(int(e["bytes"]) for e in entries),
    )


def upload(store: RemoteStore, work: Path, entries: list[dict[str, Any]], files: list[tuple[str, bytes]]) -> None:
    """Upload shards not already there at their full size, then the index, `metadata.json` last."""
    for entry in entries:
        relative = entry["path"]
        if store.exists(relative) and store.size(relative) == int(entry["bytes"]):
            continue  # uploaded by an earlier run; an object is never partly there
        store.upload(str(work / relative), relative)
    for name, data in files:
        store.write_bytes(name, data)
