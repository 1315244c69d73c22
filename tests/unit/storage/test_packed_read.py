"""A local packed cache reads each member byte once (the batch computes its checksum), one descriptor per shard."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from support.caches import make_payload, write_cache
from support.packed_copies import copy_cache, flip_member_byte, sample_in_shard

import image_edit_data.payload.payload as payload_module
from image_edit_data import ImageEditDataset
from image_edit_data.contract.paths import ContainedOpener
from image_edit_data.errors import CacheFormatError
from image_edit_data.payload.member_check import FileMember
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.storage.reader import LocalPackedReader

SHAPES = {"small": ((4, 8, 8), 5), "large": ((4, 48, 48), 40)}  # members of ~2 KiB and of ~80 KiB


@pytest.fixture(scope="module", params=sorted(SHAPES))
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape, sequence = SHAPES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    payloads = [make_payload(i, target=shape, contexts=(shape,), sequence=sequence + i % 3) for i in range(12)]
    source = write_cache(root / "source", payloads, suffix=".safetensors")
    pack_cache(
        source,
        str(root / "packed"),
        shard_bytes=4 * (os.path.getsize(source / "samples/sample_00000000.safetensors") + 1024),
    )
    return root / "packed"


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the bytes every `os.pread` and `os.preadv` returns from now on."""
    counted: list[int] = []
    pread, preadv = os.pread, os.preadv

    def counting_pread(descriptor: int, length: int, offset: int) -> bytes:
        data = pread(descriptor, length, offset)
        counted.append(len(data))
        return data

    def counting_preadv(descriptor: int, buffers: Any, offset: int, *flags: int) -> int:
        count = preadv(descriptor, buffers, offset, *flags)
        counted.append(count)
        return count

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    return counted


def test_a_checked_packed_batch_reads_each_member_byte_once(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = ImageEditDataset(packed)
    assert dataset.index.member_checksum is not None
    batch = [0, 2, 4, 6]
    expected = dataset.__getitems__(batch).batch
    counted = counting_reads(monkeypatch)
    again = dataset.__getitems__(batch).batch
    assert sum(counted) == sum(dataset.index.member(i)[2] for i in batch)  # header, tensors and hash: one pass
    assert torch.equal(again["image_latents"], expected["image_latents"])
    assert torch.equal(again["text_embeddings"], expected["text_embeddings"])


def test_each_shard_is_opened_once_per_process_and_closed_with_the_dataset(
    packed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    open_file = ContainedOpener.open

    def noting_open(self: ContainedOpener, relative: str, display: str) -> tuple[str, int, os.stat_result]:
        opened.append(relative)
        return open_file(self, relative, display)

    monkeypatch.setattr(ContainedOpener, "open", noting_open)
    dataset = ImageEditDataset(packed)
    for start in range(0, len(dataset), 3):
        dataset.__getitems__(list(range(start, min(start + 3, len(dataset)))))
    shards = sorted(shard.path for shard in dataset.index.shards)
    assert len(shards) > 2 and sorted(opened) == shards
    reader = dataset.reader
    assert isinstance(reader, LocalPackedReader)
    descriptors = [descriptor for _, descriptor in reader.files.open_files.values()]
    assert len(descriptors) == len(shards) and not reader.files.holders  # every payload gave its shard back
    copy = pickle.loads(pickle.dumps(reader))  # what a loader worker receives: it opens its own
    assert not copy.files.open_files
    dataset.close()
    for descriptor in descriptors:
        with pytest.raises(OSError):
            os.fstat(descriptor)


def test_past_the_open_file_budget_the_least_recent_shard_no_payload_holds_is_closed(packed: Path) -> None:
    dataset = ImageEditDataset(packed)
    reader = dataset.reader
    assert isinstance(reader, LocalPackedReader)
    reader.files.limit = 1
    first, other = sample_in_shard(packed, 0), sample_in_shard(packed, 1)
    held = dataset.open_sample(first)[1]
    expected = ImageEditDataset(packed)[other]["target_latent"]
    assert torch.equal(dataset[other]["target_latent"], expected)
    assert sorted(reader.files.open_files) == [0, 1]  # shard 0 is still held: never closed under a payload
    held.close()
    dataset[sample_in_shard(packed, 2)]
    assert list(reader.files.open_files) == [2]


def test_a_member_read_wrong_once_is_read_again_and_the_batch_holds_its_right_bytes(
    packed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = ImageEditDataset(packed, on_corrupt_sample="skip", max_corrupt_fraction=0.5)
    batch = [1, 3, 5]
    expected = dataset.__getitems__(batch).batch
    rereads = counting_rereads(monkeypatch)
    read_header = payload_module.read_header
    victim_offset = dataset.index.member(3)[1]

    def once_wrong(descriptor: int, size: int, display: str, base: int = 0) -> tuple[Any, Any, bytes]:
        tensors, metadata, head = read_header(descriptor, size, display, base)
        if base == victim_offset and not rereads:  # a tensor byte read wrong (it is right on disk)
            head = head[:-1] + bytes([head[-1] ^ 1])
        return tensors, metadata, head

    monkeypatch.setattr(payload_module, "read_header", once_wrong)
    again = dataset.__getitems__(batch).batch
    assert rereads == [dataset.reader.display(3)]
    assert again["metadata"]["sample_indices"] == batch and again["metadata"]["skipped"] == 0
    assert torch.equal(again["image_latents"], expected["image_latents"])
    assert torch.equal(again["context_latents"][0], expected["context_latents"][0])


def counting_rereads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The members read again whole from now on (named as errors name them)."""
    found: list[str] = []
    reread = FileMember.reread

    def noting_reread(self: FileMember) -> Any:
        found.append(self.display)
        return reread(self)

    monkeypatch.setattr(FileMember, "reread", noting_reread)
    return found


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_member_damaged_on_disk_is_read_again_once_then_refused_or_skipped(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    victim = sample_in_shard(copy, 1)
    shard, member, recorded, found = flip_member_byte(copy, victim)
    dataset = ImageEditDataset(copy, on_corrupt_sample=policy, max_corrupt_fraction=0.5)  # type: ignore[arg-type]
    bucket = int(dataset.index.bucket_ids[victim])
    others = [i for i in range(len(dataset)) if int(dataset.index.bucket_ids[i]) == bucket and i != victim][:2]
    rereads = counting_rereads(monkeypatch)
    message = f"{shard}[{member}]: xxh3_64: member bytes hash to {found}, the index says {recorded} (read from"
    if policy == "raise":
        with pytest.raises(CacheFormatError, match=re.escape(message)):
            dataset.__getitems__([victim, *others])
    else:
        batch = dataset.__getitems__([victim, *others]).batch
        assert batch["metadata"]["sample_indices"] == others
        (skip,) = batch["metadata"]["skipped_samples"]
        assert (skip["index"], skip["file"], skip["field"]) == (victim, f"{shard}[{member}]", "xxh3_64")
        assert skip["reason"].startswith(message.split(": ", 2)[2])
    assert rereads == [f"{shard}[{member}]"]  # read again whole, once, before it counted
