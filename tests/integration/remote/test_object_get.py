"""Shard downloads go through obstore where it reaches the bucket as s3fs would, and through s3fs otherwise."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import s3fs
from support.local_s3 import local_s3

from image_edit_data.errors import CacheFormatError
from image_edit_data.storage import object_get, remote
from image_edit_data.storage.location import CacheLocation
from image_edit_data.storage.object_get import object_get_settings
from image_edit_data.storage.remote import RemoteStore

KEYS = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}


@pytest.fixture
def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_aws_environment")
def test_options_that_name_keys_and_an_endpoint_or_region_are_mapped() -> None:
    settings = object_get_settings("s3://bucket/a/b", {**KEYS, "client_kwargs": {"region_name": "eu-west-1"}})
    assert settings is not None
    assert (settings.bucket, settings.region, settings.endpoint) == ("bucket", "eu-west-1", "http://127.0.0.1:9")
    assert settings.credentials == ("k", "s", None) and not settings.anonymous
    inside = object_get_settings("s3a://b", {"client_kwargs": {"endpoint_url": "http://e", "region_name": "r"}})
    assert inside is not None and inside.endpoint == "http://e" and inside.credentials is None  # botocore's chain
    anonymous = object_get_settings("s3://b/c", {"anon": True, "client_kwargs": {"region_name": "us-east-2"}})
    assert anonymous is not None and anonymous.anonymous
    ours = {"response_checksum_validation": "when_required"}
    assert object_get_settings("s3://b/c", {**KEYS, "config_kwargs": ours}) is not None


@pytest.mark.usefixtures("no_aws_environment")
@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("gs://bucket/c", KEYS),  # not S3
        ("s3://bucket/c", {**KEYS, "profile": "work"}),  # a profile is botocore's to resolve
        ("s3://bucket/c", {**KEYS, "client_kwargs": {"verify": False}}),  # TLS settings
        ("s3://bucket/c", {**KEYS, "config_kwargs": {"s3": {"addressing_style": "virtual"}}}),  # botocore config
        ("s3://bucket/c", {**KEYS, "config_kwargs": {"response_checksum_validation": "when_supported"}}),  # CRC on
        ("s3://bucket/c", {"key": "k", "secret": "s"}),  # no endpoint, no region: s3fs follows S3's redirects
        ("s3://bucket/c", {"key": "k", "endpoint_url": "http://e"}),  # half a key pair
    ],
)
def test_options_obstore_might_read_differently_keep_requests_on_s3fs(url: str, options: dict[str, Any]) -> None:
    assert object_get_settings(url, options) is None


def test_a_region_from_the_environment_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    settings = object_get_settings("s3://bucket/c", {"key": "k", "secret": "s"})
    assert settings is not None and settings.region == "ap-south-1" and settings.endpoint is None


def test_without_obstore_every_download_goes_through_s3fs(
    s3: dict[str, Any], packed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "object_get_available", lambda: False)
    store = RemoteStore(packed_url, s3)
    assert store.object_get is None
    index, _ = CacheLocation.of(packed_url, storage_options=s3).open()
    shard = index.shards[0]
    monkeypatch.setattr(remote, "get_object", lambda store, url: pytest.fail("obstore was used"))
    assert len(shard_through(store, shard.path, shard.nbytes)) == shard.nbytes


def shard_through(store: RemoteStore, path: str, size: int) -> bytes:
    pieces: list[bytes] = []
    assert store.download(path, lambda piece: pieces.append(bytes(piece)), size) == size
    return b"".join(pieces)


def test_a_shard_download_goes_through_obstore_and_brings_the_same_bytes_as_s3fs(
    s3: dict[str, Any], packed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, _ = CacheLocation.of(packed_url, storage_options=s3).open()
    shard = index.shards[1]
    expected = s3fs.S3FileSystem(**s3).cat_file(f"{packed_url.removeprefix('s3://')}/{shard.path}")
    calls: list[str] = []
    real = remote.get_object
    monkeypatch.setattr(remote, "get_object", lambda store, url: calls.append(url) or real(store, url))
    through_obstore = RemoteStore(packed_url, s3)
    assert through_obstore.object_get is not None
    assert shard_through(through_obstore, shard.path, shard.nbytes) == expected
    assert calls == [f"{packed_url}/{shard.path}"] and through_obstore.stats.requests == 1
    through_s3fs = RemoteStore(packed_url, {**s3, "config_kwargs": {"max_pool_connections": 4}})
    assert through_s3fs.object_get is None
    assert shard_through(through_s3fs, shard.path, shard.nbytes) == expected and len(calls) == 1


def test_a_missing_object_through_obstore_is_a_file_not_found_naming_it_without_retries(
    s3: dict[str, Any], packed_url: str
) -> None:
    store = RemoteStore(packed_url, s3)
    with pytest.raises(FileNotFoundError, match=rf"does not exist \(reading\): '{packed_url}/shards/none.tar'"):
        store.download("shards/none.tar", lambda piece: None, 100)
    assert store.stats.requests == 1


def download_in_a_fork(url: str, s3: dict[str, Any], path: str, size: int, results: Any) -> None:
    store = RemoteStore(url, s3)
    results.put((object_get.runtime_usable(), len(shard_through(store, path, size))))


def test_a_process_forked_after_obstore_ran_downloads_through_s3fs_instead_of_hanging(
    s3: dict[str, Any], packed_url: str
) -> None:
    index, _ = CacheLocation.of(packed_url, storage_options=s3).open()
    shard = index.shards[0]
    shard_through(RemoteStore(packed_url, s3), shard.path, shard.nbytes)  # this process's obstore runtime starts
    assert object_get.runtime_usable()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=download_in_a_fork, args=(packed_url, s3, shard.path, shard.nbytes, results))
    child.start()
    usable, received = results.get(timeout=60)
    child.join(timeout=30)
    assert (usable, received, child.exitcode) == (False, shard.nbytes, 0)


def counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """The ranged GETs sent through obstore from now on: (url, start, length)."""
    calls: list[tuple[str, int, int]] = []
    real = remote.get_range

    def noting(store: Any, url: str, start: int, length: int) -> Any:
        calls.append((url, start, length))
        return real(store, url, start, length)

    monkeypatch.setattr(remote, "get_range", noting)
    return calls


def test_ranged_reads_go_through_obstore_once_an_answer_showed_status_206_and_bring_the_same_bytes_as_s3fs(
    s3: dict[str, Any], packed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, _ = CacheLocation.of(packed_url, storage_options=s3).open()
    number, offset, length = index.member(3)
    shard = index.shards[number]
    key = f"{packed_url.removeprefix('s3://')}/{shard.path}"
    expected = s3fs.S3FileSystem(**s3).cat_file(key, start=offset, end=offset + length)
    calls = counting(monkeypatch)
    store = RemoteStore(packed_url, s3)
    assert bytes(store.read_range(shard.path, offset, length)) == expected  # through s3fs: its answer has a status
    assert calls == [] and store._serves_ranges
    assert bytes(store.read_range(shard.path, offset, length)) == expected
    assert calls == [(f"{packed_url}/{shard.path}", offset, length)] and store.stats.requests == 2
    short = rf"{key}: bytes: reading bytes .* returned 2 bytes; the object is shorter"
    with pytest.raises(CacheFormatError, match=short):
        store.read_range(shard.path, shard.nbytes - 2, 10)  # past the end: a truncated or replaced shard
    with pytest.raises(FileNotFoundError, match=rf"does not exist .*'{packed_url}/shards/none.tar'"):
        store.read_range("shards/none.tar", 0, 10)


def test_ranged_reads_from_an_endpoint_that_answers_them_with_status_200_stay_on_s3fs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`rclone serve s3` answers a ranged GET with status 200 and the range's bytes: obstore refuses that, s3fs not."""
    data = os.urandom(64 << 10)
    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "object").write_bytes(data)
    calls = counting(monkeypatch)
    with local_s3(endpoint="rclone", folder=tmp_path) as server:
        store = RemoteStore("s3://bucket", server.options)
        assert store.object_get is not None
        assert bytes(store.read_range("object", 100, 1000)) == data[100:1100]
        assert bytes(store.read_range("object", 5000, 300)) == data[5000:5300]
    assert calls == []  # never through obstore, which would refuse the answer
    assert store.stats.requests == 2 and store._serves_ranges is False  # no request failed, none was repeated
    assert "answered a ranged GET with status 200, not 206" in caplog.text
