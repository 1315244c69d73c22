"""Open a cache: metadata.json + JSON shards -> a compact columnar index.

The index keeps per sample only what sampling and loading need, in numpy arrays: the payload
path (one byte blob plus offsets), the bucket id and the token counts. That is ~50 bytes per
sample instead of a Python dict per record, and it is shared by forked workers without
copy-on-write growth because no Python objects per sample exist.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..contract import validate
from ..contract.paths import contained, read_regular_file, resolve_inside
from ..contract.signature import Signature, sort_key
from ..contract.validate import CacheFormatError, fail, show
from ..errors import read_failed
from .packed import PackedFields, ShardInfo, has_checksums, is_packed, shard_list, shards_fingerprint

MANIFEST = "metadata.json"
UNKNOWN = -1  # token count not stored in the index record
# Provenance plus a shard list: even 100k shards fit easily. Shards are not bounded: 10M records need GBs.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, eq=False)
class CacheIndex:
    """Every sample of a cache, by position: payload path, bucket and token counts."""

    root: Path
    manifest: Mapping[str, Any]
    signatures: tuple[Signature, ...]  # bucket id -> signature, cheapest first
    bucket_ids: np.ndarray  # [N] int32
    path_blob: np.ndarray  # [total bytes] uint8, UTF-8 paths relative to root, back to back
    path_offsets: np.ndarray  # [N + 1] int64
    text_tokens: np.ndarray  # [N] int32, UNKNOWN where the record does not say
    fingerprint: str = field(default="")
    # Packed layout only (see index/packed.py): the tar shards and where each sample's member lies.
    shards: tuple[ShardInfo, ...] = ()
    member_shard: np.ndarray | None = None  # [N] int32 shard number
    member_offset: np.ndarray | None = None  # [N] int64 byte offset of the member's data in its shard
    member_length: np.ndarray | None = None  # [N] int64 member length
    member_checksum: np.ndarray | None = None  # [N] uint64 XXH3-64 of each member; None: packed before checksums

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the per-sample arrays as shared memory, made once: every worker then maps the same pages.

        Workers started by a fork server or spawn receive the dataset pickled; a 1M-sample index is
        tens of MB, which each worker of each rank would otherwise hold a copy of.
        """
        shared = _SHARED.get(self)
        if shared is None:
            shared = _SHARED[self] = {name: SharedArray.of(getattr(self, name)) for name in ARRAY_FIELDS}
            for name, value in shared.items():  # this process reads the shared copy too: one copy in all
                if value is not None:
                    object.__setattr__(self, name, value.array())
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ARRAY_FIELDS}
        return (_rebuild_index, (state, shared))

    @property
    def packed(self) -> bool:
        """Whether payloads are members of tar shards rather than files of their own."""
        return self.member_shard is not None

    def member(self, index: int) -> tuple[int, int, int]:
        """(shard number, offset, length) of sample `index` in a packed cache."""
        assert self.member_shard is not None and self.member_offset is not None and self.member_length is not None
        return int(self.member_shard[index]), int(self.member_offset[index]), int(self.member_length[index])

    @property
    def unchecked(self) -> bool:
        """Whether this is a packed cache without member checksums (packed before they existed)."""
        return self.member_shard is not None and self.member_checksum is None

    def checksum(self, index: int) -> int | None:
        """The recorded checksum of sample `index`'s member, or None when the cache has none."""
        return None if self.member_checksum is None else int(self.member_checksum[index])

    def __len__(self) -> int:
        return int(self.bucket_ids.shape[0])

    def relative_path(self, index: int) -> str:
        """Payload path of sample `index`, relative to the cache root."""
        start, end = self.path_offsets[index], self.path_offsets[index + 1]
        return self.path_blob[start:end].tobytes().decode("utf-8")

    def payload_path(self, index: int) -> Path:
        """Absolute payload path of sample `index`, refusing symlinks that leave the cache."""
        relative = self.relative_path(index)
        return resolve_inside(self.root, relative, relative, "cache_file")

    def signature(self, index: int) -> Signature:
        """Compound signature of sample `index`."""
        return self.signatures[int(self.bucket_ids[index])]

    def bucket_sizes(self) -> np.ndarray:
        """[num_buckets] sample count per bucket id."""
        return np.bincount(self.bucket_ids, minlength=len(self.signatures))

    def bucket_members(self) -> list[np.ndarray]:
        """Per bucket id, the ascending sample indices in it."""
        if not self.signatures:
            return []
        order = np.argsort(self.bucket_ids, kind="stable")
        return np.split(order, np.cumsum(self.bucket_sizes())[:-1])

    @property
    def source_revision(self) -> str | None:
        """The manifest's dataset revision, which payloads that name one must match."""
        value = self.manifest.get("dataset_revision", self.manifest.get("source_revision"))
        return value if isinstance(value, str) and value else None

    @property
    def nbytes(self) -> int:
        """Memory held by the per-sample arrays."""
        arrays = (self.bucket_ids, self.path_blob, self.path_offsets, self.text_tokens)
        members = (self.member_shard, self.member_offset, self.member_length, self.member_checksum)
        packed = (a for a in members if a is not None)
        return sum(a.nbytes for a in arrays) + sum(a.nbytes for a in packed)


def _read_json(path: Path, display: str, max_bytes: int | None = None) -> Any:
    """Parse a JSON cache file (a regular file of at most `max_bytes`), naming it in any error."""
    try:
        return json.loads(read_regular_file(path, display, max_bytes).decode("utf-8"))
    except CacheFormatError:
        raise
    except FileNotFoundError:
        fail(display, "file", f"does not exist ({path})")
    except UnicodeDecodeError as error:
        fail(display, "encoding", f"expected UTF-8 JSON ({error.reason} at byte {error.start})")
    except RecursionError:
        fail(display, "json", "nesting is too deep")
    except json.JSONDecodeError as error:
        fail(display, "json", f"invalid JSON: {error.msg} at line {error.lineno} column {error.colno}")
    except ValueError as error:  # e.g. an integer literal longer than Python's 4300-digit limit
        fail(display, "json", f"invalid JSON: {error}")
    except OSError as error:
        read_failed(display, error)


def load_manifest(root: Path) -> tuple[dict[str, Any], list[str]]:
    """Read metadata.json and return it with its shard paths (relative, checked for containment)."""
    path = root / MANIFEST
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no {MANIFEST} here; is {root} an image-edit cache directory?")
    manifest = _read_json(resolve_inside(root, MANIFEST, MANIFEST, "file"), MANIFEST, MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict):
        fail(MANIFEST, "manifest", f"expected a JSON object, got {type(manifest).__name__}")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        fail(MANIFEST, "shards", f"expected a list of shard file names, got {show(shards)}")
    first: dict[str, int] = {}
    for i, shard in enumerate(shards):
        name = contained(root, shard, MANIFEST, f"shards[{i}]")
        if name == MANIFEST:
            fail(MANIFEST, f"shards[{i}]", f"{show(shard)} is the manifest itself, not an index shard")
        if name in first:
            fail(MANIFEST, f"shards[{i}]", f"{show(shard)} is listed twice (first at shards[{first[name]}])")
        first[name] = i
    return manifest, list(first)


def load_index(cache_dir: str | Path) -> CacheIndex:
    """Open the cache at `cache_dir`, checking every index rule of the contract."""
    root = Path(cache_dir).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: cache directory does not exist")
    manifest, shards = load_manifest(root)
    parsed = ParsedRecords(root)
    if is_packed(manifest):  # the packed layout adds (shard, offset, length) per record
        parsed.packed = PackedFields(shard_list(root, manifest), has_checksums(manifest))
    with _cyclic_gc_paused():
        for shard in shards:
            records = _read_json(resolve_inside(root, shard, MANIFEST, "shards"), shard)
            if not isinstance(records, list):
                fail(shard, "records", f"expected a JSON list of records, got {type(records).__name__}")
            parsed.add_shard(shard, records)
    parsed.check_unique()
    return _build_index(
        root, manifest, parsed.bucket_of, parsed.bucket_ids, parsed.paths, parsed.text_tokens, parsed.packed
    )


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector while JSON records are parsed, then restore it.

    Parsing allocates millions of dicts, each allocation counting towards the next collection,
    and every collection walks all live containers, in the process as well as the shards: on a
    large cache those walks were most of the time of the first open. Parsed JSON holds no
    reference cycles, so reference counting still frees each shard as soon as it is packed.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


ARRAY_FIELDS = (
    "bucket_ids",
    "path_blob",
    "path_offsets",
    "text_tokens",
    "member_shard",
    "member_offset",
    "member_length",
    "member_checksum",
)
# Each index's arrays in shared memory, made the first time it is pickled and kept while it lives.
_SHARED: weakref.WeakKeyDictionary[CacheIndex, dict[str, SharedArray | None]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SharedArray:
    """A numpy array's bytes in a shared-memory tensor (pickled by torch as a handle, not a copy)."""

    data: torch.Tensor  # [nbytes] uint8, shared
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, array: np.ndarray | None) -> SharedArray | None:
        """`array` copied once into shared memory (None stays None)."""
        if array is None:
            return None
        flat = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        return cls(torch.from_numpy(flat.copy()).share_memory_(), array.dtype.str, tuple(array.shape))

    def array(self) -> np.ndarray:
        """The array, viewing the shared bytes (read-only, as the index never changes)."""
        view = self.data.numpy().view(np.dtype(self.dtype)).reshape(self.shape)
        view.flags.writeable = False
        return view


def _rebuild_index(state: dict[str, Any], shared: dict[str, SharedArray | None]) -> CacheIndex:
    arrays: dict[str, Any] = {name: (None if value is None else value.array()) for name, value in shared.items()}
    return CacheIndex(**state, **arrays)


class ParsedRecords:
    """Index records checked and packed as they are read.

    Most records of a real cache look alike, so each is first tried against a cheap check (plain
    relative path, an already-seen signature spelling, well-typed counts); only a record that fails
    it goes through the full rules, which either accept it or raise with the shard and field.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bucket_of: dict[Signature, int] = {}
        self.known_signatures: dict[str, Signature] = {}  # repr of the JSON value -> checked signature
        self.checked_dirs: set[str] = set()
        self.bucket_ids: list[int] = []
        self.paths: list[bytes] = []
        self.text_tokens: list[int] = []
        self.shard_ends: list[tuple[str, int]] = []  # (shard, records so far), to name a record later
        self.packed: PackedFields | None = None

    def add_shard(self, shard: str, records: list[Any]) -> None:
        """Check and pack every record of one shard."""
        for position, record in enumerate(records):
            quick = self.quick(record)
            relative, sig = quick if quick is not None else self.checked(record, shard, f"[{position}]")
            parent = relative.rpartition("/")[0]
            if parent not in self.checked_dirs:
                # A symlinked directory could lead outside; checking each directory once keeps opening fast.
                resolve_inside(self.root, parent or ".", shard, f"[{position}].cache_file")
                self.checked_dirs.add(parent)
            self.bucket_ids.append(self.bucket_of.setdefault(sig, len(self.bucket_of)))
            self.paths.append(relative.encode("utf-8"))
            text = record.get("text_token_length")
            self.text_tokens.append(UNKNOWN if text is None else text)
            if self.packed is not None:
                self.packed.add(record, shard, f"[{position}]")
        self.shard_ends.append((shard, len(self.paths)))

    def quick(self, record: Any) -> tuple[str, Signature] | None:
        """The record's path and signature when it plainly passes every rule, else None."""
        if type(record) is not dict:
            return None
        path = record.get("cache_file")
        if type(path) is not str or not _plain_relative_path(path):
            return None
        sig = self.known_signatures.get(repr(record.get("compound_bucket_signature")))
        if sig is None:
            return None
        for name in ("target_token_length", "text_token_length"):
            value = record.get(name)
            if value is not None and (type(value) is not int or not 0 <= value <= validate.MAX_COUNT):
                return None
        contexts = record.get("context_token_lengths")
        if contexts is not None and (
            type(contexts) is not list
            or len(contexts) != len(sig.contexts)
            or not all(type(n) is int and 0 <= n <= validate.MAX_COUNT for n in contexts)
        ):
            return None
        return path, sig

    def checked(self, record: Any, shard: str, where: str) -> tuple[str, Signature]:
        """Apply every rule to a record, raising with its shard and field; remember its signature."""
        if not isinstance(record, dict):
            fail(shard, where, f"expected a record object, got {type(record).__name__}")
        if "cache_file" not in record:
            fail(shard, f"{where}.cache_file", "missing")
        relative = contained(self.root, record["cache_file"], shard, f"{where}.cache_file")
        raw = record.get("compound_bucket_signature")
        sig = validate.signature(raw, shard, f"{where}.compound_bucket_signature")
        _check_optional_counts(record, sig, shard, where)
        self.known_signatures[repr(raw)] = sig
        return relative, sig

    def check_unique(self) -> None:
        """Refuse a payload listed twice, naming both places."""
        if len(set(self.paths)) == len(self.paths):
            return
        first: dict[bytes, int] = {}
        for number, path in enumerate(self.paths):
            if path in first:
                shard, where = self.locate(number)
                earlier = "".join(map(str, self.locate(first[path])))
                fail(shard, f"{where}.cache_file", f"{path.decode()!r} is listed twice (first at {earlier})")
            first[path] = number

    def locate(self, number: int) -> tuple[str, str]:
        """(shard, `[position]`) of the `number`-th record overall."""
        start = 0
        for shard, end in self.shard_ends:
            if number < end:
                return shard, f"[{number - start}]"
            start = end
        raise IndexError(number)


def _plain_relative_path(path: str) -> bool:
    """A path that is already relative and normal, so it needs no further containment check."""
    return (
        0 < len(path) <= 1024
        and path.isascii()
        and path[0] != "/"
        and path[-1] != "/"
        and "\x00" not in path
        and ".." not in path
        and "//" not in path
        and "./" not in path
        and path != "."
    )


def _check_optional_counts(record: Mapping[str, Any], sig: Signature, file: str, where: str) -> None:
    """Validate the token counts an index record may carry."""
    for name in ("target_token_length", "text_token_length"):
        if record.get(name) is not None:
            validate.nonnegative_int(record[name], file, f"{where}.{name}")
    contexts = record.get("context_token_lengths")
    if contexts is not None:
        if not isinstance(contexts, list) or len(contexts) != len(sig.contexts):
            fail(file, f"{where}.context_token_lengths", f"expected {len(sig.contexts)} integers, got {contexts!r}")
        for i, n in enumerate(contexts):
            validate.nonnegative_int(n, file, f"{where}.context_token_lengths[{i}]")


def _build_index(
    root: Path,
    manifest: dict[str, Any],
    bucket_of: dict[Signature, int],
    bucket_ids: list[int],
    paths: list[bytes],
    text_tokens: list[int],
    packed: PackedFields | None = None,
) -> CacheIndex:
    """Pack parsed records into arrays, renumbering buckets in their stable sort order."""
    signatures = tuple(sorted(bucket_of, key=sort_key))
    renumber = np.zeros(max(len(bucket_of), 1), dtype=np.int32)
    for new_id, sig in enumerate(signatures):
        renumber[bucket_of[sig]] = new_id
    ids = renumber[np.asarray(bucket_ids, dtype=np.int64)] if bucket_ids else np.zeros(0, dtype=np.int32)
    lengths = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
    offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blob = np.frombuffer(b"".join(paths), dtype=np.uint8)
    text = np.asarray(text_tokens, dtype=np.int32)
    digest = hashlib.sha256()
    digest.update(json.dumps([s.to_json() for s in signatures]).encode())
    for array in (ids, offsets, blob):
        digest.update(np.ascontiguousarray(array).tobytes())
    members: dict[str, np.ndarray | None] = {}
    if packed is not None:  # the shard list and member locations are part of what a resume must match
        locations = packed.arrays()
        digest.update(shards_fingerprint(packed.shards))
        for array in locations.values():
            digest.update(np.ascontiguousarray(array).tobytes())
        # Not fingerprinted: the shard hashes already are, and a cache packed before checksums keeps its fingerprint.
        members = {**locations, "member_checksum": packed.checksum_array()}
    return CacheIndex(
        root=root,
        manifest=manifest,
        signatures=signatures,
        bucket_ids=ids.astype(np.int32),
        path_blob=blob,
        path_offsets=offsets,
        text_tokens=text,
        fingerprint=digest.hexdigest()[:16],
        shards=packed.shards if packed is not None else (),
        **members,  # type: ignore[arg-type]
    )
