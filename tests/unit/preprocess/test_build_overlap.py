"""Claims about a build that reads ahead of its encoders and writes behind them: what it overlaps, and that its cache
equals the one a build that overlaps nothing writes."""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.builds import DEMO_SPECS, torch_threads, write_manifest
from support.pipelines import QWEN, edit_manifest

from image_edit_data.preprocess.encoders.demo import DemoImageEncoder, DemoTextEncoder
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.encode import Prepared, Unresized, prepare, ready
from image_edit_data.preprocess.run.journal import journal_path
from image_edit_data.preprocess.run.overlap import HELPER_NICENESS, PIXEL_NICENESS, lower_priority
from image_edit_data.preprocess.run.resize import ResizePolicy, to_pixels
from image_edit_data.preprocess.run.writer import owned
from image_edit_data.preprocess.sources.base import BadSampleError
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

build_module = importlib.import_module("image_edit_data.preprocess.run.build_cache")  # the package re-exports a name
encode_module = importlib.import_module("image_edit_data.preprocess.run.encode")
RESIZE = ResizePolicy("max_pixels", max_pixels=32 * 32, spatial_alignment=16, upscale=True)


def every_file(root: Path) -> dict[str, bytes]:
    """Every file of a cache by relative path, journal included."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pixels_are_the_bytes_scaled_to_minus_one_one_as_torch_computes_them() -> None:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)) for _ in range(3)]
    stacked = torch.from_numpy(np.stack([np.asarray(image) for image in images]))
    expected = stacked.permute(0, 3, 1, 2).to(torch.float32) / 127.5 - 1.0
    pixels = to_pixels(images)
    assert torch.equal(pixels, expected) and pixels.stride() == expected.stride()
    assert torch.equal(to_pixels([images[0].convert("L")]), to_pixels([images[0].convert("L").convert("RGB")]))


def test_an_overlapped_pipeline_build_writes_the_same_bytes_as_one_that_overlaps_nothing(
    tmp_path: Path, qwen_path: Path
) -> None:
    manifest = JsonlManifestSource(edit_manifest(tmp_path / "raw", rows=7))
    spec = {"class_path": QWEN, "init_args": {"path": str(qwen_path), "torch_dtype": "float32"}}
    resize = ResizePolicy("max_pixels", max_pixels=4096, spatial_alignment=32, upscale=True)
    caches = {}
    # .pt payloads: torch.save writes the same bytes for the same tensors; a safetensors header's metadata keys
    # come out in another order from one write to the next. Both builds in this process at one torch thread, so
    # the same batches meet the same kernels.
    for name, read_ahead in (("serial", 0), ("overlapped", 16)):
        options = BuildOptions(resize=resize, batch_size=2, read_ahead=read_ahead)
        with torch_threads(1):
            report = build_cache(tmp_path / name, manifest, spec, spec, options)
        assert report.written == 7 and report.encoder_seconds > 0
        caches[name] = every_file(tmp_path / name)
    assert caches["serial"] == caches["overlapped"]
    assert "progress/rank-00000.jsonl" in caches["serial"] and len(caches["serial"]) == 7 + 4


class Recorder:
    """Read times per position and encoder calls, shared by the source and the encoder of one build."""

    reads: Counter[int] = Counter()
    next_window_read = threading.Event()
    calls: list[tuple[float, float]] = []


class RecordingSource(JsonlManifestSource):
    """A manifest source that counts each read and flags when a position of the second window is read."""

    def read(self, position: int) -> Any:
        Recorder.reads[position] += 1
        if position >= 4:
            Recorder.next_window_read.set()
        return super().read(position)


class WaitingImageEncoder(DemoImageEncoder):
    """The demo encoder, whose first call waits (up to 10 s) for a read of the next window to start."""

    def __init__(self, latent_channels: int = 4) -> None:
        super().__init__(latent_channels)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        started = time.monotonic()
        if not Recorder.calls:
            Recorder.next_window_read.wait(10)
        Recorder.calls.append((started, time.monotonic()))
        return super().encode(images)


def test_the_next_window_is_read_while_the_encoder_works_and_each_sample_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Recorder, "reads", Counter())
    monkeypatch.setattr(Recorder, "next_window_read", threading.Event())
    monkeypatch.setattr(Recorder, "calls", [])
    source = RecordingSource(write_manifest(tmp_path / "raw", rows=20))
    image = {"class_path": f"{__name__}.WaitingImageEncoder", "init_args": {}}
    options = BuildOptions(resize=RESIZE, batch_size=1, read_ahead=8)  # windows of 4 samples, 2 read ahead
    build_cache(tmp_path / "c", source, image, DEMO_SPECS[1], options)
    first_call = Recorder.calls[0]
    assert Recorder.next_window_read.is_set() and first_call[1] - first_call[0] < 10
    assert Recorder.reads == Counter(range(20))  # each position read once: no window read twice


def test_with_no_read_ahead_only_the_window_being_encoded_has_been_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Recorder, "reads", Counter())
    source = RecordingSource(write_manifest(tmp_path / "raw", rows=8))
    image = {"class_path": f"{__name__}.WaitingImageEncoder", "init_args": {}}
    seen: list[int] = []
    original = DemoImageEncoder.encode

    def encode(self: Any, images: torch.Tensor) -> torch.Tensor:
        seen.append(max(Recorder.reads))
        return original(self, images)

    monkeypatch.setattr(WaitingImageEncoder, "encode", encode)
    build_cache(tmp_path / "c", source, image, DEMO_SPECS[1], BuildOptions(resize=RESIZE, batch_size=1, read_ahead=0))
    assert seen[0] == 3  # the first window (positions 0-3) alone was read when encoding began


def disk_full_at(monkeypatch: pytest.MonkeyPatch, position: int) -> Any:
    """Make the build's payload write of `position` fail as a full disk does; returns the real `write_sample`."""
    original = build_module.write_sample

    def write_sample(root: Path, sample: Any, *args: Any) -> dict[str, Any]:
        if sample.source.position == position:
            raise OSError(28, "No space left on device")
        return original(root, sample, *args)

    monkeypatch.setattr(build_module, "write_sample", write_sample)
    return original


def test_a_failed_write_stops_the_build_with_earlier_windows_journaled_and_a_rerun_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=12))
    options = BuildOptions(resize=RESIZE, batch_size=1)  # windows of 4 samples
    original = disk_full_at(monkeypatch, 6)
    with pytest.raises(OSError, match="No space left on device"):
        build_cache(tmp_path / "c", source, *DEMO_SPECS, options)
    # The window before the failed one; neither the failed window nor the one after it, though it was written.
    journaled = journal_path(tmp_path / "c", 0).read_text().splitlines()
    assert [json.loads(line)["position"] for line in journaled] == [0, 1, 2, 3]
    monkeypatch.setattr(build_module, "write_sample", original)
    report = build_cache(tmp_path / "c", source, *DEMO_SPECS, options)
    assert (report.already_done, report.written) == (4, 8)
    build_cache(tmp_path / "whole", source, *DEMO_SPECS, options)
    assert every_file(tmp_path / "c").keys() == every_file(tmp_path / "whole").keys()


class FailingSource(JsonlManifestSource):
    """A manifest source whose read of position 5 (the second window at batch size 1) fails as a disk does."""

    def read(self, position: int) -> Any:
        if position == 5:
            raise OSError(5, "Input/output error")
        return super().read(position)


def test_a_read_that_fails_in_the_next_window_stops_the_build_after_this_window_is_journaled(tmp_path: Path) -> None:
    """The next window is read (and its pixels started) while this one encodes; its failure waits its turn."""
    source = FailingSource(write_manifest(tmp_path / "raw", rows=12))
    with pytest.raises(OSError, match="Input/output error"):
        build_cache(tmp_path / "c", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=1))
    journaled = journal_path(tmp_path / "c", 0).read_text().splitlines()
    assert [json.loads(line)["position"] for line in journaled] == [0, 1, 2, 3]


def test_a_payload_saves_its_own_row_of_a_batch_and_a_tensor_of_its_own_is_not_copied(tmp_path: Path) -> None:
    """The encoder's thread keeps each latent as a row of its batch's output; the writer copies only what needs it."""
    batch = torch.arange(4 * 2 * 3 * 3, dtype=torch.float32).reshape(4, 2, 3, 3)
    row = owned(batch[1])
    assert torch.equal(row, batch[1]) and row.untyped_storage().nbytes() == row.numel() * 4 < batch.numel() * 4
    alone = torch.ones(2, 3, 3)
    assert owned(alone) is alone, "a tensor that is all of its block is saved as it is"
    assert owned(alone, torch.bfloat16).dtype == torch.bfloat16
    torch.save({"latent": owned(batch[2])}, tmp_path / "row.pt")
    torch.save({"latent": batch[2]}, tmp_path / "view.pt")
    assert (tmp_path / "row.pt").stat().st_size < (tmp_path / "view.pt").stat().st_size  # the view saves all 4 rows


def test_the_builds_helper_threads_run_below_the_encoders_thread_and_the_pixel_threads_between() -> None:
    """Linux gives each thread a priority of its own: the readers' and writers' yield a core to the pixel threads',
    and both to the encoders'."""
    seen: list[int] = []

    def helper(*steps: int) -> None:
        lower_priority(*steps)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for steps in ((), (PIXEL_NICENESS,)):
        thread = threading.Thread(target=helper, args=steps)
        thread.start()
        thread.join()
    assert seen == [min(19, base + HELPER_NICENESS), min(19, base + PIXEL_NICENESS)]
    assert base < seen[1] < seen[0] or base >= 14, "a process already near 19 has no room for three levels"
    assert os.getpriority(os.PRIO_PROCESS, 0) == base, "the calling thread keeps its priority"


def test_a_deferred_resize_knows_its_size_and_gives_the_image_the_policy_gives(tmp_path: Path) -> None:
    """The first window's images are read without resizing; their sizes, errors and pixels are the policy's."""
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=6))
    unchanged = []
    for position in range(6):
        now, later = prepare(source, position, RESIZE, 8), prepare(source, position, RESIZE, 8, defer_resize=True)
        assert isinstance(now, Prepared) and isinstance(later, Prepared)
        for resized, deferred in zip((now.target, *now.contexts), (later.target, *later.contexts)):
            assert isinstance(deferred, Unresized) and isinstance(resized, Image.Image)
            assert deferred.size == resized.size
            assert torch.equal(to_pixels([ready(deferred)]), to_pixels([resized]))
            unchanged.append(deferred.image.size == resized.size)
    assert unchanged.count(False) >= 6, "most raw images change size (some are at their policy's size already)"
    strict = ResizePolicy("none", spatial_alignment=16)
    now, later = prepare(source, 0, strict, 8), prepare(source, 0, strict, 8, defer_resize=True)
    assert isinstance(now, BadSampleError) and isinstance(later, BadSampleError) and str(now) == str(later)


def test_the_first_window_is_resized_on_the_pixel_threads_and_the_rest_when_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So the encoder starts once the first window is decoded; later windows are resized well ahead of it."""
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=12))
    threads: Counter[str] = Counter()
    original = ResizePolicy.apply

    def apply(self: ResizePolicy, image: Image.Image, factor: int) -> Image.Image:
        threads[threading.current_thread().name.rpartition("_")[0]] += 1
        return original(self, image, factor)

    monkeypatch.setattr(ResizePolicy, "apply", apply)
    build_cache(tmp_path / "c", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=1))  # windows of 4
    images = [1 + 1 + (p % 5 == 0) for p in range(12)]  # target, context, and a second context every fifth
    assert threads == {"build-pixels": sum(images[:4]), "build-io": sum(images[4:])}


def test_the_encoders_thread_neither_allocates_pixel_batches_nor_makes_their_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mapping 12 MB for a batch's pixels had kept the encoders' thread waiting for the process's memory map."""
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=12))
    threads: Counter[tuple[str, str]] = Counter()
    for name in ("pixel_rows", "pixel_batch"):
        original = getattr(encode_module, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            threads[_name, threading.current_thread().name.rpartition("_")[0]] += 1
            return _original(*args)

        monkeypatch.setattr(encode_module, name, counted)
    build_cache(tmp_path / "c", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=2))
    batches = sum(threads.values()) // 2
    images = sum(1 + 1 + (p % 5 == 0) for p in range(12))  # target, context, and a second context every fifth
    assert batches >= -(-images // 2)  # two images to a batch at most
    assert threads == {("pixel_rows", "build-pixels"): batches, ("pixel_batch", "build-pixels"): batches}


class Gate:
    """Positions a `GatedSource` reads only once an encoder was called (waiting up to 10 s each), and those that
    waited in vain."""

    opened = threading.Event()
    held: range = range(0)
    timed_out: list[int] = []


class GatedSource(JsonlManifestSource):
    """A manifest source whose reads of `Gate.held` wait for an encoder's first call."""

    def read(self, position: int) -> Any:
        if position in Gate.held and not Gate.opened.wait(10):
            Gate.timed_out.append(position)
        return super().read(position)


class OpeningImageEncoder(DemoImageEncoder):
    """The demo image encoder, which opens the `Gate` at its first call."""

    def __init__(self, latent_channels: int = 4) -> None:
        super().__init__(latent_channels)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        Gate.opened.set()
        return super().encode(images)


class OpeningTextEncoder(DemoTextEncoder):
    """The demo text encoder, which opens the `Gate` at its first call."""

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        Gate.opened.set()
        return super().encode(prompts)


def gate(monkeypatch: pytest.MonkeyPatch, held: range) -> None:
    monkeypatch.setattr(Gate, "opened", threading.Event())
    monkeypatch.setattr(Gate, "held", held)
    monkeypatch.setattr(Gate, "timed_out", [])


def test_the_encoder_starts_a_window_without_waiting_for_the_next_one_to_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next window is awaited on a thread of its own, not before the encoder takes this one."""
    gate(monkeypatch, range(4, 8))  # the second window at batch size 1: read once the image encoder has started
    source = GatedSource(write_manifest(tmp_path / "raw", rows=12))
    image = {"class_path": f"{__name__}.OpeningImageEncoder", "init_args": {}}
    report = build_cache(tmp_path / "c", source, image, DEMO_SPECS[1], BuildOptions(resize=RESIZE, batch_size=1))
    assert report.written == 12 and Gate.timed_out == []


def test_the_first_windows_prompts_are_encoded_as_its_samples_are_read_and_the_cache_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing overlaps the first window's reading, so its prompt batches start as their samples arrive."""
    gate(monkeypatch, range(2, 8))  # the first window past its first prompt batch, at batch size 2
    manifest = write_manifest(tmp_path / "raw", rows=13)
    text = {"class_path": f"{__name__}.OpeningTextEncoder", "init_args": {"dim": 8}}
    options = BuildOptions(resize=RESIZE, batch_size=2)  # windows of 8 samples, prompts 2 at a time
    build_cache(tmp_path / "held", GatedSource(manifest), DEMO_SPECS[0], text, options)
    assert Gate.timed_out == []
    serial = BuildOptions(resize=RESIZE, batch_size=2, read_ahead=0)
    build_cache(tmp_path / "serial", JsonlManifestSource(manifest), DEMO_SPECS[0], text, serial)
    assert every_file(tmp_path / "held") == every_file(tmp_path / "serial")


def test_progress_counts_each_window_once_its_journal_lines_are_written_and_a_rerun_starts_from_what_was_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=10))
    seen: list[tuple[int, int]] = []
    serial = BuildOptions(resize=RESIZE, batch_size=1, read_ahead=0)  # each window journaled before the next
    build_cache(tmp_path / "serial", source, *DEMO_SPECS, serial, on_progress=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 10), (4, 10), (8, 10), (10, 10), (10, 10)]  # windows of 4 samples: 0-3, 4-7, 8-9
    seen.clear()
    options = BuildOptions(resize=RESIZE, batch_size=1)
    original = disk_full_at(monkeypatch, 9)
    with pytest.raises(OSError):
        build_cache(tmp_path / "c", source, *DEMO_SPECS, options, on_progress=lambda d, t: seen.append((d, t)))
    # Windows 0-3 and 4-7 were written; each is counted once reported, in order (reports may lag a failure).
    assert seen[0] == (0, 10) and seen == sorted(seen) and {d for d, _ in seen} <= {0, 4, 8}
    monkeypatch.setattr(build_module, "write_sample", original)
    seen.clear()
    build_cache(tmp_path / "c", source, *DEMO_SPECS, options, on_progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (8, 10) and seen[-1] == (10, 10) and {d for d, _ in seen} == {8, 10}
