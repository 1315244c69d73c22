"""The stored compact index equals the parsed shards, is reused while current and rebuilt when not."""

from __future__ import annotations

import gc
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from support.caches import tiny_cache

from image_edit_data import CacheFormatError
from image_edit_data.index import store as index_store
from image_edit_data.index.index import ParsedRecords, load_index
from image_edit_data.index.store import STORE_DIR, open_index


def same(a: object, b: object) -> None:
    for name in ("bucket_ids", "path_blob", "path_offsets", "text_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.signatures == b.signatures  # type: ignore[attr-defined]
    assert a.fingerprint == b.fingerprint  # type: ignore[attr-defined]
    assert a.manifest == b.manifest  # type: ignore[attr-defined]


def test_stored_index_equals_the_json_shards(tmp_path: Path) -> None:
    root = tiny_cache(tmp_path, shards=3)
    parsed = open_index(root)
    stored_files = list((root / STORE_DIR).glob("index-*.npz"))
    assert len(stored_files) == 1
    reopened = open_index(root)
    same(parsed, reopened)
    shards = [json.loads((root / f"metadata_shard_{s:04d}.json").read_text()) for s in range(3)]
    paths = [r["cache_file"] for shard in shards for r in shard]
    assert [reopened.relative_path(i) for i in range(len(reopened))] == paths
    for i, record in enumerate(r for shard in shards for r in shard):
        assert reopened.signature(i).to_json() == record["compound_bucket_signature"]


def test_reopening_does_not_parse_the_shards_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tiny_cache(tmp_path)
    open_index(root)

    def refuse(_: object) -> None:
        raise AssertionError("the shards were parsed again")

    monkeypatch.setattr(index_store, "load_index", refuse)
    assert len(open_index(root)) == 12


def test_a_changed_shard_is_parsed_again(tmp_path: Path) -> None:
    root = tiny_cache(tmp_path)
    open_index(root)
    shard = root / "metadata_shard_0000.json"
    records = json.loads(shard.read_text())
    shard.write_text(json.dumps(records[:5]))
    assert len(open_index(root)) == 5
    assert len(list((root / STORE_DIR).glob("index-*.npz"))) == 2


def test_a_read_only_cache_stores_its_index_in_the_user_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits, so simulate a read-only cache by failing writes beside it
        original = index_store.write_bytes_atomic

        def read_only(path: Path, data: bytes) -> None:
            if STORE_DIR in str(path):
                raise PermissionError(13, "read-only file system")
            original(path, data)

        monkeypatch.setattr(index_store, "write_bytes_atomic", read_only)
    root = tiny_cache(tmp_path / "cache")
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        open_index(root)
    finally:
        root.chmod(0o755)
    assert not (root / STORE_DIR).exists()
    assert len(list((tmp_path / "xdg").rglob("index-*.npz"))) == 1


def test_a_corrupt_stored_index_is_ignored_and_replaced(tmp_path: Path) -> None:
    root = tiny_cache(tmp_path)
    open_index(root)
    (stored,) = (root / STORE_DIR).glob("index-*.npz")
    stored.write_bytes(b"not an npz")
    same(open_index(root), load_index(root))
    assert stored.read_bytes()[:2] == b"PK"


def test_index_memory_is_compact(tmp_path: Path) -> None:
    index = open_index(tiny_cache(tmp_path))
    per_sample = index.nbytes / len(index)
    assert per_sample < 100  # paths of ~27 bytes + ids and counts; no Python object per sample


@pytest.mark.parametrize("enabled_before", [True, False])
def test_parsing_pauses_the_cycle_collector_and_restores_it_even_on_a_bad_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled_before: bool
) -> None:
    root = tiny_cache(tmp_path, shards=2)
    seen_while_parsing: list[bool] = []
    add_shard = ParsedRecords.add_shard

    def noting_add_shard(self: ParsedRecords, shard: str, records: list) -> None:
        seen_while_parsing.append(gc.isenabled())
        add_shard(self, shard, records)

    monkeypatch.setattr(ParsedRecords, "add_shard", noting_add_shard)
    was = gc.isenabled()
    try:
        gc.enable() if enabled_before else gc.disable()
        load_index(root)
        assert seen_while_parsing == [False, False] and gc.isenabled() is enabled_before
        shard = root / "metadata_shard_0001.json"
        shard.write_text(json.dumps([{"cache_file": "../outside.pt"}]))
        with pytest.raises(CacheFormatError, match="metadata_shard_0001.json"):
            load_index(root)
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable() if was else gc.disable()
