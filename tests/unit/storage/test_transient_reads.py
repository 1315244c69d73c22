"""Claim: a local read that fails for a reason outside the bytes is retried, then raised: never a skipped sample.

EIO, EMFILE, ESTALE and ETIMEDOUT are injected into the system calls the reader makes (opening a
payload or shard, reading tensors into the batch, reading a member to check it); a fault that passes
is retried and the batch equals an undisturbed one; one that persists is a `CacheReadError` naming the
file, under the "skip" policy too, with nothing quarantined. A missing file stays a content fault.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.caches import tiny_cache

from image_edit_data import CacheFormatError, CacheReadError, ImageEditDataset
from image_edit_data.preprocess.tools.pack import pack_cache


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("files"), counts=(4, 3), suffix=".safetensors")


@pytest.fixture(scope="module")
def packed(files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "packed"
    pack_cache(files, str(out), shard_bytes=8192)
    return out


def failing(real: Callable[..., Any], code: int, times: int, when: Callable[..., bool] = lambda *a: True) -> Any:
    """`real`, but the first `times` calls that match `when` raise OSError(`code`)."""
    left = [times]

    def call(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0 and when(*args):
            left[0] -= 1
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    return call


def batch_of(dataset: ImageEditDataset) -> list[torch.Tensor]:
    batch = dataset.__getitems__([0, 1]).batch
    assert batch["metadata"]["sample_indices"] == [0, 1]
    return [batch["image_latents"].clone(), batch["text_embeddings"].clone()]


def quarantined(dataset: ImageEditDataset) -> bool:
    return bool(dataset.skips.skipped) or (
        dataset.skips.quarantine_file is not None and dataset.skips.quarantine_file.exists()
    )


@pytest.mark.parametrize("layout", ["files", "packed"])
@pytest.mark.parametrize("code", [errno.EIO, errno.EMFILE, errno.ESTALE, errno.ETIMEDOUT])
def test_an_open_that_fails_twice_is_retried_and_the_batch_is_the_same(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layout: str, code: int
) -> None:
    cache = request.getfixturevalue(layout)
    expected = batch_of(ImageEditDataset(cache))
    dataset = ImageEditDataset(cache, on_corrupt_sample="skip", quarantine_file=tmp_path / "q.jsonl")
    is_data = lambda path, *rest: str(path).endswith((".safetensors", ".tar"))  # noqa: E731
    monkeypatch.setattr(os, "open", failing(os.open, code, 2, is_data))
    got = batch_of(dataset)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not quarantined(dataset)


@pytest.mark.parametrize("layout", ["files", "packed"])
def test_a_read_into_the_batch_that_fails_twice_is_retried_and_the_batch_is_the_same(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    cache = request.getfixturevalue(layout)
    expected = batch_of(ImageEditDataset(cache))
    dataset = ImageEditDataset(cache, on_corrupt_sample="skip")
    monkeypatch.setattr(os, "preadv", failing(os.preadv, errno.EIO, 2))
    monkeypatch.setattr(os, "pread", failing(os.pread, errno.EIO, 2))
    got = batch_of(dataset)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not dataset.skips.skipped


@pytest.mark.parametrize("layout", ["files", "packed"])
@pytest.mark.parametrize("call", ["open", "preadv"])
def test_a_read_that_keeps_failing_is_a_read_error_naming_the_file_and_never_a_skipped_sample(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layout: str, call: str
) -> None:
    cache = request.getfixturevalue(layout)
    dataset = ImageEditDataset(cache, on_corrupt_sample="skip", quarantine_file=tmp_path / "q.jsonl")
    is_data = lambda path, *rest: not isinstance(path, int) and str(path).endswith((".safetensors", ".tar"))  # noqa: E731
    when = is_data if call == "open" else (lambda *a: True)
    monkeypatch.setattr(os, call, failing(getattr(os, call), errno.EIO, 10**6, when))
    monkeypatch.setattr(os, "pread", failing(os.pread, errno.EIO, 10**6))
    with pytest.raises(
        CacheReadError, match=r"(\.safetensors|\.tar).*: cannot be read: Input/output error \(tried 3 times\)"
    ):
        dataset.__getitems__([0, 1])
    assert not quarantined(dataset), "an I/O error says nothing about the sample"


def test_a_missing_payload_file_is_still_a_content_fault_that_skip_drops(files: Path, tmp_path: Path) -> None:
    copy = tiny_cache(tmp_path / "copy", counts=(4,), suffix=".safetensors")
    dataset = ImageEditDataset(copy, on_corrupt_sample="skip", max_corrupt_fraction=0.5)
    (copy / dataset.index.relative_path(1)).unlink()
    with pytest.raises(CacheFormatError, match="cannot be read: No such file"):
        ImageEditDataset(copy)[1]
    batch = dataset.__getitems__([0, 1]).batch
    assert [s["index"] for s in batch["metadata"]["skipped_samples"]] == [1]


def test_a_read_inside_a_batch_is_tried_as_often_as_its_error_says_and_no_more(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose header does not parse is read again whole; that read keeps failing. It is tried three times,
    the error says three, and the batch around it is not tried again (which would multiply the tries)."""
    copy = tmp_path / "packed"
    shutil.copytree(packed, copy)
    dataset = ImageEditDataset(copy, on_corrupt_sample="skip")
    number, offset, length = dataset.index.member(0)
    shard = copy / dataset.index.shards[number].path
    data = bytearray(shard.read_bytes())
    data[offset : offset + 8] = b"\xff" * 8  # a header length no member can hold
    shard.write_bytes(bytes(data))
    seen: list[int] = []
    real = os.pread

    def pread(descriptor: int, size: int, at: int) -> bytes:
        if at == offset and size == length:
            seen.append(size)
            if len(seen) > 1:  # the first read parses the header; every read of the whole member after it fails
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(descriptor, size, at)

    monkeypatch.setattr(os, "pread", pread)
    with pytest.raises(CacheReadError, match=r"cannot be read: Input/output error \(tried 3 times\)"):
        dataset.__getitems__([0, 1])
    assert len(seen) - 1 == 3
    assert not dataset.skips.skipped
