"""Caches in object storage: a real S3 endpoint (moto's server on 127.0.0.1) and injected faults.

One server serves the whole module. Packing writes to it; the loader reads it with 0 and 2
workers, by ranged requests and through the local shard cache; a DataModule fit killed after a
checkpoint resumes exactly from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem
from support import SUPPORT
from support.caches import tiny_cache
from support.fits import FitOptions, SimulatedKill, cli_fit_config, fit
from support.packed_copies import drop_checksums
from support.process_group import run_process_group

from image_edit_data.__main__ import main
from image_edit_data.dataloader_config import ImageEditDataloaderConfig
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.errors import CacheFormatError
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.preprocess.tools.pack import pack_cache
from image_edit_data.storage.location import CacheLocation
from image_edit_data.storage.remote import RemoteError, RemoteStore, RequestPolicy
from image_edit_data.storage.remote_reader import RemotePackedReader
from image_edit_data.storage.shard_cache import ShardCache


def batches(cache: str | Path, workers: int, **options: Any) -> list[list[int]]:
    config = ImageEditDataloaderConfig(str(cache), num_workers=workers, prefetch_factor=1, **options)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    try:
        return [b["metadata"]["sample_indices"] for b in built.dataloader]
    finally:
        if built.sampler.observer is not None:
            built.sampler.observer.close()  # returns at once: downloads in flight end on their own
            downloads_ended(options.get("local_cache_dir"))


def downloads_ended(local: str | None, within: float = 30.0) -> None:
    """Wait until the downloads a closed prefetcher left in flight have ended (each within its request's bound)."""
    deadline = time.monotonic() + within
    while local and list(Path(local).glob("*/shards/.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.02)


def fs(options: dict[str, Any]) -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True, **options)


def test_a_cache_packed_into_s3_validates_and_inspects_there(
    s3: dict[str, Any], packed_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cache_main(["validate", packed_url, "--storage-options", json.dumps(s3)]) == 0
    assert cache_main(["inspect", packed_url, "--storage-options", json.dumps(s3)]) == 0
    shown = capsys.readouterr().out
    assert "ok: 16 samples" in shown and "packed: 13 tar shard(s)" in shown
    with pytest.raises(ValueError, match="already holds a finished cache"):
        pack_cache("unused", packed_url, storage_options=s3)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["range", "shard_cache"])
def test_the_loader_reads_an_s3_packed_cache_like_the_local_source(
    s3: dict[str, Any], source: Path, packed_url: str, tmp_path: Path, workers: int, mode: str
) -> None:
    local = batches(source, workers)
    remote = batches(
        packed_url,
        workers,
        storage_options=s3,
        remote_read=mode,
        local_cache_dir=str(tmp_path),
        shard_cache_bytes=5 * 10240,
    )
    assert remote == local
    shards = list(tmp_path.glob("*/shards/*.tar"))
    assert (len(shards) > 0) == (mode == "shard_cache")
    assert sum(p.stat().st_size for p in shards) <= 5 * 10240
    assert not list(tmp_path.glob("*/shards/.*.tmp"))


def test_a_one_file_per_sample_cache_in_s3_reads_like_the_local_one(
    s3: dict[str, Any], source: Path, tmp_path: Path
) -> None:
    fs(s3).put(str(source), "bucket/files", recursive=True)
    remote = ImageEditDataset("s3://bucket/files", storage_options=s3, local_cache_dir=str(tmp_path))
    assert not remote.index.packed
    assert remote[5]["metadata"] == ImageEditDataset(source)[5]["metadata"]
    assert batches("s3://bucket/files", 0, storage_options=s3, local_cache_dir=str(tmp_path)) == batches(source, 0)


def test_a_missing_object_is_the_content_fault_a_missing_local_file_is_and_skip_drops_it(
    s3: dict[str, Any], tmp_path: Path
) -> None:
    local = tiny_cache(tmp_path / "local", counts=(4, 3), suffix=".safetensors")
    fs(s3).put(str(local), "bucket/holes", recursive=True)
    remote = ImageEditDataset("s3://bucket/holes", storage_options=s3, local_cache_dir=str(tmp_path / "mirror"))
    victim = remote.index.relative_path(5)
    (local / victim).unlink()
    fs(s3).rm(f"bucket/holes/{victim}")
    with pytest.raises(CacheFormatError, match=r"file: cannot be read: No such file") as on_disk:
        ImageEditDataset(local)[5]
    with pytest.raises(CacheFormatError, match=rf"s3://bucket/holes/{victim}: file: cannot be read: does not exist"):
        remote[5]
    assert on_disk.value.field == "file"
    skip = {"on_corrupt_sample": "skip", "max_corrupt_fraction": 0.5}
    quarantine = tmp_path / "remote.jsonl"
    options = dict(storage_options=s3, local_cache_dir=str(tmp_path / "mirror"), quarantine_file=str(quarantine))
    assert batches("s3://bucket/holes", 0, **options, **skip) == batches(local, 0, **skip)  # the same samples dropped
    (line,) = quarantine.read_text().splitlines()
    assert json.loads(line)["file"] == f"s3://bucket/holes/{victim}" and json.loads(line)["field"] == "file"


def copy_packed(s3: dict[str, Any], packed_url: str, name: str) -> str:
    fs(s3).copy(packed_url.removeprefix("s3://"), f"bucket/{name}", recursive=True)
    return f"s3://bucket/{name}"


def test_a_missing_shard_is_a_content_fault_naming_its_url(s3: dict[str, Any], packed_url: str, tmp_path: Path) -> None:
    url = copy_packed(s3, packed_url, "missing")
    dataset = ImageEditDataset(url, storage_options=s3, local_cache_dir=str(tmp_path))
    shard = dataset.index.shards[0].path
    fs(s3).rm(f"bucket/missing/{shard}")
    victim = next(i for i in range(len(dataset)) if dataset.index.member(i)[0] == 0)
    with pytest.raises(CacheFormatError, match=rf"{url}/{shard}\[.*\]: file: cannot be read: does not exist"):
        dataset[victim]


def test_a_truncated_or_replaced_shard_is_refused_and_leaves_nothing_in_the_local_cache(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    url = copy_packed(s3, packed_url, "damaged")
    index, reader = CacheLocation.of(url, storage_options=s3, local_cache_dir=str(tmp_path)).open()
    assert reader is not None and reader.store is not None
    first, second = index.shards[0], index.shards[1]
    data = fs(s3).cat_file(f"bucket/damaged/{first.path}")
    fs(s3).pipe_file(f"bucket/damaged/{first.path}", data[:700])  # cut inside the first member
    victim = next(i for i in range(len(index)) if index.member(i)[0] == 0)
    with pytest.raises(CacheFormatError, match=rf"{url}/{first.path}: bytes: reading bytes .* returned \d+ bytes"):
        reader.open(victim)  # a content fault, as a local shard of the wrong size is
    tampered = bytearray(fs(s3).cat_file(f"bucket/damaged/{second.path}"))
    tampered[-100] ^= 1
    fs(s3).pipe_file(f"bucket/damaged/{second.path}", bytes(tampered))
    cache = ShardCache(reader.store, index.shards, tmp_path / "shards", 10 * 10240)
    with pytest.raises(ValueError, match=rf"{url}/{first.path}: bytes: shard is 700 bytes"):
        cache.fetch(0)
    assert second.xxh3_128 is not None  # packed now: downloads check the XXH3-128, not the slower SHA-256
    with pytest.raises(ValueError, match=rf"{url}/{second.path}: xxh3_128: shard hashes to [0-9a-f]{{32}}, .* says"):
        cache.fetch(1)
    left = sorted(p.name for p in (tmp_path / "shards").iterdir() if p.suffix != ".pin")
    assert left == sorted([".lock", f"{first.sha256}.damaged", f"{second.sha256}.damaged"])  # verdicts, no bytes


def test_a_budget_smaller_than_one_shard_is_refused(s3: dict[str, Any], packed_url: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"shard_cache_bytes=4096 is smaller than shard s3://bucket/packed/shards/"):
        ImageEditDataset(
            packed_url,
            storage_options=s3,
            remote_read="shard_cache",
            shard_cache_bytes=4096,
            local_cache_dir=str(tmp_path),
        )


def test_eviction_never_removes_a_pinned_shard_and_orphaned_downloads_are_cleaned(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    index, reader = CacheLocation.of(packed_url, storage_options=s3, local_cache_dir=str(tmp_path)).open()
    assert reader is not None and reader.store is not None
    directory = tmp_path / "shards"
    directory.mkdir()
    orphan = directory / f".{index.shards[5].sha256}.999999999.1.tmp"  # a download by a process that is gone
    orphan.write_bytes(b"half")
    cache = ShardCache(reader.store, index.shards, directory, 2 * 10240)
    assert not orphan.exists()
    cache.pin({0, 1})
    assert cache.fetch(0) and cache.fetch(1)
    assert not cache.fetch(2)  # both cached shards are pinned: no room, nothing evicted
    assert cache.local_path(0).exists() and cache.local_path(1).exists()
    other = ShardCache(reader.store, index.shards, directory, 2 * 10240)  # another process on the node
    assert not other.fetch(2)
    cache.pin({1})
    assert other.fetch(2) and not cache.local_path(0).exists() and cache.local_path(1).exists()
    assert cache.high_water <= 2 * 10240 and other.high_water <= 2 * 10240


class FlakyFileSystem(LocalFileSystem):
    """A local filesystem whose ranged reads fail `failures` times before working (a flaky network)."""

    protocol = "flaky"
    calls = 0

    def __init__(self, failures: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failures = failures

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        FlakyFileSystem.calls += 1
        if start is not None and FlakyFileSystem.calls <= self.failures:
            raise ConnectionError("connection reset by peer")
        return bytes(super().cat_file(self._strip_protocol(path), start=start, end=end, **kwargs))

    @classmethod
    def _strip_protocol(cls, path: str) -> str:  # type: ignore[override]
        return super()._strip_protocol(path.removeprefix("flaky://"))


def test_transient_errors_are_retried_then_reported_with_the_url(packed_url: str, tmp_path: Path) -> None:
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    packed = tmp_path / "packed"
    pack_cache(tiny_cache(tmp_path / "src", counts=(2,), suffix=".safetensors"), str(packed), shard_bytes=8192)
    fast = RequestPolicy(attempts=3, base_delay=0.01)
    FlakyFileSystem.calls = 0
    store = RemoteStore(f"flaky://{packed}", {"failures": 2}, retry=fast)
    assert len(store.read_range("shards/b0000-000000.tar", 512, 100)) == 100
    assert store.stats.requests == 3
    FlakyFileSystem.calls = 0
    store = RemoteStore(f"flaky://{packed}", {"failures": 5}, retry=fast)
    with pytest.raises(RemoteError, match=rf"flaky://{packed}/shards/b0000-000000.tar: .* failed after 3 attempts"):
        store.read_range("shards/b0000-000000.tar", 512, 100)


def test_a_remote_store_pickles_without_its_client_and_makes_a_new_one_per_process(s3: dict[str, Any]) -> None:
    import pickle

    store = RemoteStore("s3://bucket/packed", s3)
    client = store.fs
    copy = pickle.loads(pickle.dumps(store))
    assert copy._fs is None and copy.fs is not client
    store._pid = -1  # as if this were a forked child: the parent's client is not reused
    assert store.fs is not client


def records(out: Path) -> list[tuple[int, list[int]]]:
    return [(line["epoch"], line["ids"]) for line in map(json.loads, (out / "rank0.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("mode", ["range", "shard_cache"])
def test_a_fit_on_an_s3_cache_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path, mode: str
) -> None:
    common = dict(storage_options=json.dumps(s3), remote_read=mode, local_cache_dir=str(tmp_path / "local"))
    whole = FitOptions(packed_url, str(tmp_path / "whole"), epochs=2, in_process=True, **common)  # type: ignore[arg-type]
    fit(whole)
    broken = whole | {"out": str(tmp_path / "run"), "kill_at_step": 5}
    with pytest.raises(SimulatedKill):
        fit(broken)
    fit(broken | {"kill_at_step": None, "ckpt": str(tmp_path / "run" / "ckpt" / "step=5.ckpt")})
    assert records(tmp_path / "run") == records(tmp_path / "whole")


@pytest.mark.slow
def test_a_real_fit_with_workers_on_s3_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    """A real process killed after a checkpoint (its workers and shard downloads die with it); the resume reads the
    shard cache it left."""
    harness = SUPPORT / "fits.py"
    common = ["--storage-options", json.dumps(s3), "--remote-read", "shard_cache", "--num-workers", "2"]
    common += ["--local-cache-dir", str(tmp_path / "local"), "--epochs", "2"]

    def run(out: str, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(harness), packed_url, str(tmp_path / out), *common, *extra]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        return run_process_group(command, timeout=300, env=env)

    # The data order does not depend on workers, so an in-process run gives the uninterrupted baseline.
    options = dict(storage_options=json.dumps(s3), remote_read="range", local_cache_dir=str(tmp_path / "local"))
    fit(FitOptions(packed_url, str(tmp_path / "whole"), epochs=2, in_process=True, **options))  # type: ignore[arg-type]
    killed = run("run", "--kill-at-step", "6")
    assert killed.returncode == 17, killed.stderr[-2000:]
    # The resume, with workers on the shard cache the killed run left, runs here: one Lightning start less.
    checkpoint = str(tmp_path / "run" / "ckpt" / "step=6.ckpt")
    resume = options | {"remote_read": "shard_cache", "num_workers": 2, "ckpt": checkpoint}
    fit(FitOptions(packed_url, str(tmp_path / "run"), epochs=2, in_process=True, **resume))  # type: ignore[arg-type]
    assert records(tmp_path / "run") == records(tmp_path / "whole")


def test_the_prefetcher_downloads_the_shards_the_plan_reads_next_within_the_budget(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    config = ImageEditDataloaderConfig(
        packed_url,
        num_workers=0,
        storage_options=s3,
        remote_read="shard_cache",
        local_cache_dir=str(tmp_path),
        shard_cache_bytes=3 * 10240,
        shard_window=1,
    )
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    sampler, prefetcher = built.sampler, built.sampler.observer
    assert prefetcher is not None
    first = next(iter(sampler))  # handing out step 0 starts the downloads
    prefetcher.wait()
    cache = prefetcher.cache
    shard_of = built.dataloader.dataset.index.member_shard
    assert all(cache.local_path(int(shard_of[i])).exists() for i in first)
    cached = list((cache.directory).glob("*.tar"))
    assert 1 <= len(cached) <= 3 and cache.high_water <= 3 * 10240
    prefetcher.close()


def test_a_shard_another_process_is_downloading_is_not_fetched_twice(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    index, reader = CacheLocation.of(packed_url, storage_options=s3, local_cache_dir=str(tmp_path)).open()
    assert reader is not None and reader.store is not None
    directory = tmp_path / "shards"
    cache = ShardCache(reader.store, index.shards, directory, 4 * 10240)
    busy = directory / f".{index.shards[3].sha256}.{os.getpid()}.7.tmp"  # a live process's download
    busy.write_bytes(b"")
    assert not cache.fetch(3) and not cache.local_path(3).exists()
    assert [p.name for p in directory.glob(".*.tmp")] == [busy.name]
    assert cache.downloads({2, 3}) == {3: busy}
    cache.wait_for({3: busy}, timeout=0.05)  # a reader waits a bounded time, then reads ranges
    assert cache.open_cached(3) is None
    busy.unlink()
    assert cache.fetch(3)
    opened = cache.open_cached(3)
    assert opened is not None
    os.close(opened[0])


def cli_config(path: Path, out: Path, url: str, s3: dict[str, Any], kill_at_step: int | None) -> Path:
    """A LightningCLI fit config: the recording model, 2 workers, the S3 packed cache through the shard cache."""
    remote = {"storage_options": s3, "remote_read": "shard_cache", "local_cache_dir": str(path.parent / "local")}
    return cli_fit_config(path, out, {"cache_dir": url, "batch_size": 2, "num_workers": 2, **remote}, kill_at_step)


def test_a_lightning_cli_fit_with_workers_on_s3_killed_after_a_checkpoint_resumes_exactly(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    whole, run = tmp_path / "whole", tmp_path / "run"
    main(["fit", "--config", str(cli_config(tmp_path / "whole.yaml", whole, packed_url, s3, None))])
    killed = cli_config(tmp_path / "killed.yaml", run, packed_url, s3, 5)
    with pytest.raises(SimulatedKill):
        main(["fit", "--config", str(killed)])
    resumed = cli_config(tmp_path / "resumed.yaml", run, packed_url, s3, None)
    main(["fit", "--config", str(resumed), "--ckpt_path", str(run / "ckpt" / "step=5.ckpt")])
    assert len(records(run)) > 5 and records(run) == records(whole)


PLANTED = {"key": "AKIAPLANTED7KEY3ID", "secret": "planted-secret-4c1e9b", "token": "planted-token-77aa0f"}


def planted_in(path: Path) -> list[str]:
    """The planted credentials found in a file's bytes (a checkpoint's zip members are stored uncompressed)."""
    data = path.read_bytes()
    return [value for value in PLANTED.values() if value.encode() in data]


def test_credentials_never_reach_a_checkpoint_a_logged_or_printed_config_a_log_or_an_error_and_resume_still_works(
    s3: dict[str, Any],
    packed_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from image_edit_data.lightning import ImageEditDataModule

    out = tmp_path / "run"
    options = {**s3, **PLANTED}  # moto accepts any key; the clients sign every request with these
    data = {"cache_dir": packed_url, "batch_size": 2, "num_workers": 0, "storage_options": options}
    config = cli_config_with_logger(tmp_path / "fit.yaml", out, data | {"local_cache_dir": str(tmp_path / "local")})
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--print_config"])
    printed = capsys.readouterr().out
    assert "AKIAPLANTED" not in printed and "planted-" not in printed and "<redacted>" in printed
    main(["fit", "--config", str(config)])
    files = [*out.rglob("*.ckpt"), *out.rglob("hparams.yaml"), *out.rglob("config.yaml")]
    assert {path.suffix for path in files} == {".ckpt", ".yaml"} and len(files) >= 3, files
    assert {str(path): planted_in(path) for path in files} == {str(path): [] for path in files}
    assert not [value for value in PLANTED.values() if value in caplog.text]
    hparams = next(out.rglob("hparams.yaml")).read_text()
    assert "secret: <redacted>" in hparams and f"endpoint_url: {s3['endpoint_url']}" in hparams  # the rest stays
    # Resuming: the checkpoint's module reads the cache with the credentials of the environment (as botocore does).
    module = ImageEditDataModule.load_from_checkpoint(str(next(out.rglob("*.ckpt"))))
    module.setup("fit")
    assert module.train_dataset is not None and len(module.train_dataset[0]["metadata"]) > 0
    # An error names endpoint and object, never a credential, even one inside the endpoint's URL.
    with silent_port() as port:
        store = RemoteStore(
            packed_url,
            {**options, "endpoint_url": f"http://AKIAPLANTED7KEY3ID:planted-secret-4c1e9b@127.0.0.1:{port}"},
            RequestPolicy(connect_timeout=0.2, read_timeout=0.2, attempts=1, deadline=0.3),
        )
        with pytest.raises(RemoteError) as raised:
            store.read_range("shards/b0000-000000.tar", 0, 10)
    shown = f"{raised.value} {raised.value.__notes__ if hasattr(raised.value, '__notes__') else ''} {store!r}"
    assert "127.0.0.1" in shown and not [value for value in PLANTED.values() if value in shown], shown


def cli_config_with_logger(path: Path, out: Path, data: dict[str, Any]) -> Path:
    """A LightningCLI fit config for one short epoch with a CSV logger (it writes hparams.yaml) and checkpoints."""
    import yaml

    trainer = {"accelerator": "cpu", "devices": 1, "max_epochs": 1, "limit_train_batches": 2}
    trainer |= {"enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": str(out)}
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out)}}
    model = {"class_path": "support.fits.RecordingModel", "init_args": {"out": str(out)}}
    path.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}))
    return path


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def damage_member(s3: dict[str, Any], url: str, index: Any, sample: int) -> tuple[str, str, str, str]:
    """Flip one byte inside sample `sample`'s member in the bucket.

    Returns the member's display, its recorded and its damaged checksum, and the damaged shard's SHA-256.
    """
    number, offset, length = index.member(sample)
    key = f"{url.removeprefix('s3://')}/{index.shards[number].path}"
    client = fs(s3)  # one client: making one costs more than the requests
    data = bytearray(client.cat_file(key))
    data[offset + length - 10] ^= 0x01
    client.pipe_file(key, bytes(data))
    display = f"{url}/{index.shards[number].path}[{index.relative_path(sample)}]"
    recorded = f"{index.checksum(sample):016x}" if index.member_checksum is not None else ""
    found = xxhash.xxh3_64_hexdigest(bytes(data[offset : offset + length]))
    return display, recorded, found, hashlib.sha256(data).hexdigest()


def two_in_shard(index: Any, number: int) -> tuple[int, int]:
    first, second = [i for i in range(len(index)) if index.member(i)[0] == number][:2]
    return first, second


def test_a_flipped_byte_inside_a_member_is_fetched_again_once_then_refused_in_range_mode_naming_both_checksums(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    url = copy_packed(s3, packed_url, "flipped-range")
    dataset = ImageEditDataset(url, storage_options=s3, local_cache_dir=str(tmp_path))
    store = dataset.reader.store  # type: ignore[attr-defined]
    victim, neighbour = two_in_shard(dataset.index, 0)
    expected = ImageEditDataset(packed_url, storage_options=s3, local_cache_dir=str(tmp_path / "intact"))[neighbour]
    display, recorded, found, _ = damage_member(s3, url, dataset.index, victim)
    message = f"{display}: xxh3_64: member bytes hash to {found}, the index says {recorded} (ranged read"
    requests = store.stats.requests
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        dataset[victim]
    assert store.stats.requests - requests == 2  # fetched, then fetched again before it counted as damaged
    assert torch.equal(dataset[neighbour]["target_latent"], expected["target_latent"])  # the shard's intact members


def test_a_range_damaged_in_flight_is_fetched_again_and_the_batch_holds_its_right_bytes(
    s3: dict[str, Any], packed_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip = {"on_corrupt_sample": "skip", "max_corrupt_fraction": 0.5}
    dataset = ImageEditDataset(packed_url, storage_options=s3, local_cache_dir=str(tmp_path), **skip)  # type: ignore[arg-type]
    victim, other = two_in_shard(dataset.index, 1)
    expected = dataset.__getitems__([victim, other]).batch
    _, offset, _ = dataset.index.member(victim)
    real = RemoteStore.read_range
    damaged: list[int] = []

    def once_damaged(self: RemoteStore, relative: str, start: int, length: int) -> Any:
        data = real(self, relative, start, length)
        if start == offset and not damaged:  # the first answer for the victim loses a bit on the way
            damaged.append(start)
            data = bytearray(data)
            data[length // 2] ^= 0x04
        return data

    monkeypatch.setattr(RemoteStore, "read_range", once_damaged)
    again = dataset.__getitems__([victim, other]).batch
    assert damaged == [offset] and again["metadata"]["skipped"] == 0
    assert again["metadata"]["sample_indices"] == [victim, other]
    for key in ("image_latents", "text_embeddings"):
        assert torch.equal(again[key], expected[key]), key


def test_a_damaged_shard_is_marked_for_the_node_and_its_damaged_member_is_not_served_by_a_ranged_read(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    url = copy_packed(s3, packed_url, "flipped-cache")
    options = dict(remote_read="shard_cache", shard_cache_bytes=10 * 10240)
    dataset = ImageEditDataset(url, storage_options=s3, local_cache_dir=str(tmp_path), **options)  # type: ignore[arg-type]
    reader, index = dataset.reader, dataset.index
    assert isinstance(reader, RemotePackedReader) and reader.shard_cache is not None
    cache, shard = reader.shard_cache, index.shards[0]
    victim, neighbour = two_in_shard(index, 0)
    display, recorded, found, _ = damage_member(s3, url, index, victim)
    with pytest.raises(ValueError, match=rf"{url}/{shard.path}: xxh3_128: .* the manifest says {shard.xxh3_128} .*"):
        cache.fetch(0)  # what the prefetcher does first
    assert not cache.local_path(0).exists() and (cache.directory / f"{shard.sha256}.damaged").is_file()
    requests = reader.store.stats.requests
    assert not cache.fetch(0) and reader.store.stats.requests == requests  # never downloaded again
    message = f"{display}: xxh3_64: member bytes hash to {found}, the index says {recorded} (ranged read"
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        dataset[victim]
    assert reader.fallbacks == 1
    dataset[neighbour]


def old_format_copy(s3: dict[str, Any], packed_url: str, name: str) -> str:
    """A copy of the packed cache in the bucket, its index rewritten as before member checksums."""
    url = copy_packed(s3, packed_url, name)
    prefix, client = url.removeprefix("s3://"), fs(s3)
    drop_checksums(
        lambda file: client.cat_file(f"{prefix}/{file}"), lambda file, data: client.pipe_file(f"{prefix}/{file}", data)
    )
    return url


def test_no_reader_on_the_node_reads_a_shard_marked_damaged_of_a_cache_without_member_checksums(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    url = old_format_copy(s3, packed_url, "old-damaged")
    options = dict(remote_read="shard_cache", shard_cache_bytes=10 * 10240)
    index, reader = CacheLocation.of(url, storage_options=s3, local_cache_dir=str(tmp_path), **options).open()  # type: ignore[arg-type]
    assert reader is not None and reader.shard_cache is not None and reader.store is not None
    assert index.member_checksum is None
    victim, neighbour = two_in_shard(index, 0)
    display, _, _, found = damage_member(s3, url, index, victim)
    with pytest.raises(ValueError, match="sha256: shard hashes to"):
        reader.shard_cache.fetch(0)
    message = (
        f"sha256: shard hashes to {found}, the manifest says {index.shards[0].sha256}; the shard is marked damaged"
    )
    requests = reader.store.stats.requests
    with pytest.raises(CacheFormatError, match=re.escape(f"{display}: {message}")):
        reader.open(victim)
    with pytest.raises(CacheFormatError, match="none of its members is read"):
        reader.open(neighbour)  # intact or not, nothing of it can be checked
    assert reader.store.stats.requests == requests
    _, other = CacheLocation.of(
        url, storage_options=s3, local_cache_dir=str(tmp_path)
    ).open()  # another reader, range mode
    assert other is not None and other.store is not None
    requests = other.store.stats.requests
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        other.open(victim)
    assert other.store.stats.requests == requests


def test_skip_drops_a_damaged_member_the_same_way_in_both_read_modes_and_quarantines_it(
    s3: dict[str, Any], source: Path, packed_url: str, tmp_path: Path
) -> None:
    url = copy_packed(s3, packed_url, "flipped-skip")
    index, _ = CacheLocation.of(url, storage_options=s3, local_cache_dir=str(tmp_path / "probe")).open()
    victim = two_in_shard(index, 1)[0]
    display, _, _, _ = damage_member(s3, url, index, victim)
    clean = [[i for i in b if i != victim] for b in batches(source, 0)]
    for mode in ("range", "shard_cache"):
        quarantine = tmp_path / f"{mode}.jsonl"
        common = dict(storage_options=s3, remote_read=mode, local_cache_dir=str(tmp_path / mode))
        common |= dict(on_corrupt_sample="skip", max_corrupt_fraction=0.5, quarantine_file=str(quarantine))
        assert batches(url, 0, shard_cache_bytes=3 * 10240, **common) == clean, mode
        (line,) = quarantine.read_text().splitlines()
        assert json.loads(line)["file"] == display and json.loads(line)["field"] == "xxh3_64"


def mark_in_a_process(url: str, s3: dict[str, Any], local: str) -> None:
    _, reader = CacheLocation.of(url, storage_options=s3, local_cache_dir=local, remote_read="shard_cache").open()
    assert reader is not None and reader.shard_cache is not None
    try:
        reader.shard_cache.fetch(0)
    except ValueError:
        return
    raise AssertionError("the damaged shard was accepted")


def read_in_a_process(url: str, s3: dict[str, Any], local: str, sample: int, results: Any) -> None:
    _, reader = CacheLocation.of(url, storage_options=s3, local_cache_dir=local, remote_read="shard_cache").open()
    assert reader is not None and reader.store is not None
    requests = reader.store.stats.requests
    try:
        reader.open(sample).close()
        results.put(("served", reader.store.stats.requests - requests))
    except CacheFormatError as error:
        results.put((str(error), reader.store.stats.requests - requests))


@pytest.mark.slow
def test_a_shard_marked_damaged_by_one_process_is_not_read_by_another(
    s3: dict[str, Any], packed_url: str, tmp_path: Path
) -> None:
    """Real processes: the mark must reach a reader in another process on the node."""
    url = old_format_copy(s3, packed_url, "old-damaged-processes")
    index, _ = CacheLocation.of(url, storage_options=s3, local_cache_dir=str(tmp_path / "probe")).open()
    victim = two_in_shard(index, 0)[1]
    damage_member(s3, url, index, two_in_shard(index, 0)[0])
    context = multiprocessing.get_context("fork")
    marker = context.Process(target=mark_in_a_process, args=(url, s3, str(tmp_path / "node")))
    marker.start()
    marker.join(timeout=120)
    assert marker.exitcode == 0
    results = context.Queue()
    reader = context.Process(target=read_in_a_process, args=(url, s3, str(tmp_path / "node"), victim, results))
    reader.start()
    message, requests = results.get(timeout=120)
    reader.join(timeout=60)
    assert "the shard is marked damaged on this node" in message and requests == 0


def test_every_remote_layout_opens_through_one_reader_that_hands_the_loader_its_prefetcher(
    s3: dict[str, Any], source: Path, packed_url: str, tmp_path: Path
) -> None:
    fs(s3).put(str(source), "bucket/layouts", recursive=True)
    options = {"storage_options": s3, "local_cache_dir": str(tmp_path)}
    files = CacheLocation.of("s3://bucket/layouts", **options)
    ranged = CacheLocation.of(packed_url, **options)
    cached = CacheLocation.of(packed_url, remote_read="shard_cache", **options)
    readers = {name: location.open()[1] for name, location in (("files", files), ("range", ranged), ("cache", cached))}
    assert {name: type(reader).__name__ for name, reader in readers.items()} == {
        "files": "RemoteFilesReader",
        "range": "RemotePackedReader",
        "cache": "RemotePackedReader",
    }
    assert not files.is_local and files.quarantine_default() is None
    assert readers["files"].prefetcher(5) is None and readers["range"].prefetcher(5) is None
    prefetcher = readers["cache"].prefetcher(5)
    assert prefetcher is not None and (prefetcher.ahead, prefetcher.behind) == (14, 5)
    prefetcher.close()
    built = ImageEditDataloaderConfig(packed_url, num_workers=0, remote_read="shard_cache", **options).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    assert built.sampler.observer is not None  # the loader took the reader's prefetcher
    built.sampler.observer.close()
