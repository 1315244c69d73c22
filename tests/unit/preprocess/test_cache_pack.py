"""`cache pack` writes tar shards grouped by bucket; the packed cache reads, validates and resumes like the source."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from support.caches import same_samples, tiny_cache
from support.packed_copies import copy_cache, drop_local_checksums, flip_member_byte, sample_in_shard

from image_edit_data.contract.validate import CacheFormatError
from image_edit_data.dataloader_config import ImageEditDataloaderConfig
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.index.index import CacheIndex
from image_edit_data.index.store import open_index, serialize
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.sampling.plan import plan_epoch
from image_edit_data.sampling.sampler import BucketBatchSampler, ResumeMismatchError


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("src"), counts=(7, 5, 4))


@pytest.fixture(scope="module")
def packed(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "cache"
    assert cache_main(["pack", str(source), str(out), "--shard-bytes", "8192"]) == 0
    return out


def test_a_packed_cache_holds_the_same_samples_in_the_same_order(source: Path, packed: Path) -> None:
    a, b = ImageEditDataset(source), ImageEditDataset(packed)
    assert b.index.packed and len(b.index.shards) > 3
    assert np.array_equal(a.index.bucket_ids, b.index.bucket_ids)
    same_samples(a, b)


def test_every_shard_is_a_plain_tar_of_one_bucket_whose_offsets_the_index_records(packed: Path) -> None:
    index = open_index(packed, use_store=False)
    for number, shard in enumerate(index.shards):
        with tarfile.open(packed / shard.path) as archive:
            members = {m.name: m for m in archive.getmembers()}
        mine = [i for i in range(len(index)) if index.member(i)[0] == number]
        assert sorted(members) == sorted(index.relative_path(i) for i in mine)
        assert len({int(index.bucket_ids[i]) for i in mine}) == 1
        for i in mine:
            member = members[index.relative_path(i)]
            assert (member.offset_data, member.size) == index.member(i)[1:]
    assert index.member_offset is not None and index.member_offset.dtype == np.int64


def test_a_killed_pack_resumes_and_writes_the_same_shards(source: Path, packed: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"

    def die(done: int, total: int) -> None:
        if done == 9:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        pack_cache(source, str(out), shard_bytes=8192, on_progress=die)
    assert not (out / "metadata.json").exists()
    assert not [p for p in (out / "shards").iterdir() if p.name.endswith(".tmp")]
    report = pack_cache(source, str(out), shard_bytes=8192)
    assert 0 < report.reused < report.samples
    assert (
        json.loads((out / "metadata.json").read_text())["packed_shards"]
        == json.loads((packed / "metadata.json").read_text())["packed_shards"]
    )
    with pytest.raises(ValueError, match="already holds a finished cache"):
        pack_cache(source, str(out), shard_bytes=8192)


def test_the_manifest_records_each_shard_s_sha256_and_xxh3_128(packed: Path) -> None:
    entries = json.loads((packed / "metadata.json").read_text())["packed_shards"]
    for entry, shard in zip(entries, open_index(packed, use_store=False).shards, strict=True):
        data = (packed / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() == shard.sha256
        assert entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data) == shard.xxh3_128


def test_a_manifest_with_a_malformed_shard_xxh3_128_is_refused_naming_the_field(packed: Path, tmp_path: Path) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    manifest = json.loads((copy / "metadata.json").read_text())
    manifest["packed_shards"][1]["xxh3_128"] = "ABC"
    (copy / "metadata.json").write_text(json.dumps(manifest))
    expected = r"metadata.json: packed_shards\[1\].xxh3_128: expected 32 lowercase hex"
    with pytest.raises(CacheFormatError, match=expected):
        open_index(copy, use_store=False)


def test_each_shard_reaches_its_file_in_one_write_not_in_tarfile_s_16_kib_copies(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # How a file was written decides how the page cache holds it: one written in small pieces reads
    # back from there at half the speed (docs/performance-remote.md). Count what reaches each file.
    writes: dict[str, list[int]] = {}

    class Recording(io.FileIO):
        def write(self, data: Any) -> int:
            writes.setdefault(os.readlink(f"/proc/self/fd/{self.fileno()}"), []).append(len(memoryview(data)))
            return super().write(data)

    real = os.fdopen

    def fdopen(fd: int, mode: str = "r", buffering: int = -1) -> Any:
        if mode != "wb":
            return real(fd, mode, buffering)
        size = buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE
        return io.BufferedWriter(Recording(fd, "wb"), buffer_size=size)

    monkeypatch.setattr(os, "fdopen", fdopen)
    pack_cache(source, str(tmp_path / "cache"), shard_bytes=64 << 10)  # shards of several 8 KiB buffers' worth
    shards = {path: sizes for path, sizes in writes.items() if ".tar." in Path(path).name}
    assert shards and all(len(sizes) == 1 for sizes in shards.values()), shards
    assert max(sum(sizes) for sizes in shards.values()) > 16 << 10  # more than one of tarfile's copies


def test_a_rerun_with_another_shard_size_is_refused(source: Path, tmp_path: Path) -> None:
    (tmp_path / "cache" / "progress").mkdir(parents=True)
    (tmp_path / "cache" / "progress" / "pack-settings.json").write_text(
        json.dumps({"version": 1, "source": ImageEditDataset(source).index.fingerprint, "shard_bytes": 4096})
    )
    with pytest.raises(ValueError, match="shard_bytes: cache built with 4096, now 8192"):
        pack_cache(source, str(tmp_path / "cache"), shard_bytes=8192)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_a_packed_cache_the_same_batches_as_its_source(
    source: Path, packed: Path, workers: int
) -> None:
    def batches(cache: Path) -> list[list[int]]:
        config = ImageEditDataloaderConfig(str(cache), num_workers=workers, prefetch_factor=1)
        built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
        return [b["metadata"]["sample_indices"] for b in built.dataloader]

    assert batches(packed) == batches(source)


def test_validate_reports_a_shard_whose_hash_does_not_match(
    packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in packed.rglob("*"):
        if path.is_file() and ".image_edit_data" not in path.parts:
            (copy / path.relative_to(packed)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(packed)).write_bytes(path.read_bytes())
    shard = copy / ImageEditDataset(copy).index.shards[0].path
    data = bytearray(shard.read_bytes())
    data[-600] ^= 0xFF  # in the tar's end padding: every sample still loads, only the hash changes
    shard.write_bytes(bytes(data))
    assert cache_main(["validate", str(copy)]) == 1
    shown = capsys.readouterr().out
    assert "0 of 16 samples are bad" in shown and "b0000-000000.tar: sha256: shard hashes to" in shown
    assert "b0000-000000.tar: xxh3_128: shard hashes to" in shown  # what downloads check, checked here too
    assert cache_main(["inspect", str(copy)]) == 0
    assert "packed: " in capsys.readouterr().out


def test_a_truncated_shard_is_refused_naming_it(packed: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    for path in packed.rglob("*"):
        if path.is_file() and ".image_edit_data" not in path.parts:
            (copy / path.relative_to(packed)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(packed)).write_bytes(path.read_bytes())
    dataset = ImageEditDataset(copy)
    first = dataset.index.shards[0]
    (copy / first.path).write_bytes((copy / first.path).read_bytes()[:1000])
    victim = next(i for i in range(len(dataset)) if dataset.index.member(i)[0] == 0)
    with pytest.raises(CacheFormatError, match=rf"{first.path}: bytes: shard is 1000 bytes, the manifest says"):
        dataset[victim]


def test_a_record_whose_member_ends_beyond_its_shard_is_refused_when_the_index_loads(
    packed: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("metadata.json", "metadata_shard_0000.json"):
        (copy / name).write_text((packed / name).read_text())
    records = json.loads((copy / "metadata_shard_0000.json").read_text())
    records[3]["length"] = 10**12
    (copy / "metadata_shard_0000.json").write_text(json.dumps(records))
    with pytest.raises(CacheFormatError, match=r"metadata_shard_0000.json: \[3\].length: member bytes .* end beyond"):
        ImageEditDataset(copy, use_index_store=False)


def test_a_stored_packed_index_reopens_with_the_same_members(packed: Path) -> None:
    first, second = open_index(packed), open_index(packed)
    assert second.fingerprint == first.fingerprint and second.shards == first.shards
    assert second.member_offset is not None and first.member_offset is not None
    assert np.array_equal(second.member_offset, first.member_offset)
    assert second.member_checksum is not None and first.member_checksum is not None
    assert np.array_equal(second.member_checksum, first.member_checksum)


def test_a_shard_local_shuffle_is_a_pure_function_that_keeps_windows_of_shards_together(packed: Path) -> None:
    index = open_index(packed)
    members = index.bucket_members()
    shard_of = index.member_shard
    assert shard_of is not None

    def plan(epoch: int) -> np.ndarray:
        options = dict(seed=3, epoch=epoch, world_size=1, shuffle=True, drop_last=False, order="sequential")
        return plan_epoch(members, [1] * len(members), shard_of=shard_of, shard_window=1, **options).flat  # type: ignore[arg-type]

    assert np.array_equal(plan(0), plan(0)) and not np.array_equal(plan(0), plan(1))
    assert sorted(plan(0).tolist()) == list(range(len(index)))
    runs = [int(s) for s, _ in __import__("itertools").groupby(shard_of[plan(0)])]
    assert len(runs) == len(set(runs)) == len(index.shards)  # window 1: each shard read in one go


def shard_sampler(index: CacheIndex, window: int, **options: Any) -> BucketBatchSampler:
    members = index.bucket_members()
    return BucketBatchSampler(
        bucket_members=members,
        batch_sizes=[2] * len(members),
        data_fingerprint=index.fingerprint,
        shard_of=index.member_shard,
        shard_window=window,
        **options,
    )


def test_a_shard_window_sampler_resumes_mid_epoch_exactly_and_refuses_another_window(packed: Path) -> None:
    index = open_index(packed)
    whole = [list(b) for b in shard_sampler(index, 2, epoch=1)]
    first = shard_sampler(index, 2, epoch=1)
    taken = [list(b) for _, b in zip(range(3), first)]
    resumed = shard_sampler(index, 2)
    resumed.load_state_dict(first.state_dict())
    assert taken + [list(b) for b in resumed] == whole
    with pytest.raises(ResumeMismatchError, match="shard_window: checkpoint 2, now None"):
        shard_sampler(index, 0).load_state_dict(first.state_dict())


def test_a_shard_window_sampler_resumes_elastically_on_fewer_ranks_with_every_sample_once(packed: Path) -> None:
    index = open_index(packed)
    options = dict(drop_last=False, elastic=True)
    ranks = [shard_sampler(index, 2, rank=r, world_size=2, **options) for r in range(2)]  # type: ignore[arg-type]
    seen = [i for sampler in ranks for _, b in zip(range(2), sampler) for i in b]
    single = shard_sampler(index, 2, **options)  # type: ignore[arg-type]
    single.load_state_dict(ranks[0].state_dict())
    seen += [i for b in single for i in b]
    assert sorted(set(seen)) == list(range(len(index)))


def test_a_file_url_reads_as_the_local_directory(packed: Path) -> None:
    local, url = ImageEditDataset(packed), ImageEditDataset(f"file://{packed}")
    assert url.reader is not None and url.reader.store is None  # read in place, no fsspec round trip
    assert torch.equal(url[4]["target_latent"], local[4]["target_latent"])


def test_every_record_carries_the_xxh3_64_of_its_member_bytes(packed: Path) -> None:
    assert json.loads((packed / "metadata.json").read_text())["member_checksum"] == "xxh3_64"
    index = open_index(packed, use_store=False)
    assert index.member_checksum is not None and index.member_checksum.dtype == np.uint64
    for i in range(len(index)):
        number, offset, length = index.member(i)
        data = (packed / index.shards[number].path).read_bytes()[offset : offset + length]
        assert index.checksum(i) == xxhash.xxh3_64_intdigest(data)


def test_a_flipped_byte_inside_a_member_is_refused_naming_shard_member_and_both_checksums(
    packed: Path, tmp_path: Path
) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    victim, neighbour = sample_in_shard(copy, 0), sample_in_shard(copy, 0, skip=1)
    shard, member, recorded, found = flip_member_byte(copy, victim)
    dataset = ImageEditDataset(copy)
    message = f"{shard}[{member}]: xxh3_64: member bytes hash to {found}, the index says {recorded}"
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        dataset[victim]
    assert torch.equal(dataset[neighbour]["target_latent"], ImageEditDataset(packed)[neighbour]["target_latent"])


def test_validate_names_a_damaged_member_and_pack_does_not_copy_it(
    packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    shard, member, recorded, found = flip_member_byte(copy, sample_in_shard(copy, 1))
    assert cache_main(["validate", str(copy)]) == 1
    shown = capsys.readouterr().out
    assert "1 of 16 samples are bad" in shown and "member checksums: xxh3_64, checked on every read" in shown
    assert f"{shard}[{member}]: xxh3_64: member bytes hash to {found}, the index says {recorded}" in shown
    with pytest.raises(CacheFormatError, match=re.escape(f"[{member}]: xxh3_64: member bytes hash to {found}")):
        pack_cache(copy, str(tmp_path / "repacked"), shard_bytes=8192)


def test_pack_reads_each_shard_back_and_stops_at_a_member_written_wrong(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = tarfile.TarFile.addfile

    def damaging(self: tarfile.TarFile, info: tarfile.TarInfo, fileobj: Any = None) -> None:
        data = bytearray(fileobj.read())
        data[-10] ^= 0x01  # what a faulty write path would leave on disk
        write(self, info, io.BytesIO(bytes(data)))

    monkeypatch.setattr(tarfile.TarFile, "addfile", damaging)
    pattern = r"b0000-000000\.tar\[samples/sample_\d+\.safetensors\]: xxh3_64: member bytes hash to [0-9a-f]{16}, "
    with pytest.raises(CacheFormatError, match=pattern + r"the index says [0-9a-f]{16} \(as written by this pack"):
        pack_cache(source, str(tmp_path / "cache"), shard_bytes=8192)
    assert not (tmp_path / "cache" / "metadata.json").exists()


def test_a_cache_packed_before_checksums_reads_as_before_and_validate_says_it_has_none(
    packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = drop_local_checksums(copy_cache(packed, tmp_path / "old"))
    dataset = ImageEditDataset(old)
    assert dataset.index.packed and dataset.index.member_checksum is None
    same_samples(ImageEditDataset(packed), dataset)
    pack_cache(old, str(tmp_path / "repacked"), shard_bytes=8192)  # adds the checksums
    repacked = ImageEditDataset(tmp_path / "repacked")
    assert repacked.index.member_checksum is not None
    assert [dataclasses.replace(s, xxh3_128=None) for s in repacked.index.shards] == list(dataset.index.shards)
    assert all(s.xxh3_128 is not None for s in repacked.index.shards)
    # Checksums are not part of the data fingerprint: a run on the old cache resumes on its repack.
    assert repacked.index.fingerprint == dataset.index.fingerprint
    assert cache_main(["validate", str(old)]) == 0
    shown = capsys.readouterr().out
    assert "ok: 16 samples" in shown and "member checksums: none (packed before they existed)" in shown
    assert cache_main(["inspect", str(old)]) == 0
    assert "member checksums: none (packed before them)" in capsys.readouterr().out


def test_a_stored_index_without_the_checksums_its_manifest_declares_is_parsed_again(
    packed: Path, tmp_path: Path
) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    index = open_index(copy)
    (stored,) = (copy / ".image_edit_data").glob("index-*.npz")
    stored.write_bytes(serialize(dataclasses.replace(index, member_checksum=None)))  # as older code stored it
    again = open_index(copy)
    assert again.member_checksum is not None and index.member_checksum is not None
    assert np.array_equal(again.member_checksum, index.member_checksum)


def test_an_unknown_checksum_algorithm_or_a_malformed_checksum_is_refused_when_the_index_loads(
    packed: Path, tmp_path: Path
) -> None:
    copy = copy_cache(packed, tmp_path / "copy")
    manifest = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**manifest, "member_checksum": "md5"}))
    with pytest.raises(CacheFormatError, match=r"metadata.json: member_checksum: expected 'xxh3_64' .* got 'md5'"):
        ImageEditDataset(copy, use_index_store=False)
    (copy / "metadata.json").write_text(json.dumps(manifest))
    records = json.loads((copy / "metadata_shard_0000.json").read_text())
    records[3]["xxh3_64"] = "not hex"
    (copy / "metadata_shard_0000.json").write_text(json.dumps(records))
    pattern = r"metadata_shard_0000.json: \[3\].xxh3_64: expected 16 lowercase hex digits, got 'not hex'"
    with pytest.raises(CacheFormatError, match=pattern):
        ImageEditDataset(copy, use_index_store=False)
