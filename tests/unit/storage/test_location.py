"""A cache location is parsed once, and every local layout opens through the one reader interface."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.caches import tiny_cache

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.storage.location import CacheLocation
from image_edit_data.storage.reader import LocalFilesReader, LocalPackedReader


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    files = tiny_cache(tmp_path_factory.mktemp("files"), counts=(5, 3), suffix=".safetensors")
    packed = tmp_path_factory.mktemp("packed") / "cache"
    pack_cache(files, str(packed), shard_bytes=8192)
    return files, packed


def test_a_path_and_a_file_url_are_local_and_a_bucket_url_is_not(tmp_path: Path) -> None:
    path = CacheLocation.of(tmp_path)
    url = CacheLocation.of(f"file://{tmp_path}")
    bucket = CacheLocation.of("s3://bucket/cache", storage_options={"anon": True})
    assert path.local_path == url.local_path == tmp_path and path.is_local and url.is_local
    assert path.display == tmp_path and url.display == f"file://{tmp_path}"  # a URL is shown as written
    assert path.quarantine_default() == tmp_path / ".image_edit_data" / "quarantine.jsonl"
    assert bucket.local_path is None and not bucket.is_local and bucket.quarantine_default() is None
    assert bucket.storage_options == {"anon": True}
    assert CacheLocation.of(bucket) is bucket  # parsed once, passed on as it is


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"remote_read": "download"}, r"remote_read must be one of \('range', 'shard_cache'\), got 'download'"),
        ({"shard_cache_bytes": 0}, "shard_cache_bytes must be a positive integer, got 0"),
    ],
)
def test_bad_remote_options_are_refused_when_the_location_is_parsed(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheLocation.of("s3://bucket/cache", **options)


def test_local_files_and_local_shards_open_through_their_readers_and_read_the_same_samples(
    caches: tuple[Path, Path],
) -> None:
    files, packed = caches
    one, other = ImageEditDataset(files), ImageEditDataset(f"file://{packed}")
    assert isinstance(one.reader, LocalFilesReader) and isinstance(other.reader, LocalPackedReader)
    assert one.reader.prefetcher(5) is None and other.reader.prefetcher(5) is None  # nothing to fetch ahead
    assert one.reader.display(0) == one.index.relative_path(0)
    assert other.reader.display(0).startswith(other.index.shards[other.index.member(0)[0]].path + "[")
    for index in range(len(one)):
        assert one[index]["metadata"] == other[index]["metadata"]
