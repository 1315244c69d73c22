"""The data monitor logs throughput, data wait and bucket ids per step and summarises buckets per epoch."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import Logger
from support.caches import tiny_cache
from support.trainers import RecordingLogger, TinyModel, quiet_trainer
from torch.utils.data import DataLoader, Dataset

import image_edit_data.lightning.monitor as monitor_module
from image_edit_data import ImageEditDataModule, ImageEditDataset
from image_edit_data.lightning.monitor import ImageEditDataMonitor

pytestmark = pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")

SIG_A = "target=4x8x8/contexts=[4x8x8]"
SIG_B = "target=4x4x8/contexts=[]"
STEP_METRICS = {
    "data/samples_per_sec",
    "data/latent_tokens_per_sec",
    "data/text_tokens_per_sec",
    "data/wait_fraction",
    "data/bucket_id",
    "data/skipped_samples",
}
EPOCH_METRICS = {
    "data/epoch_batches",
    "data/epoch_samples",
    "data/epoch_skipped_samples",
    "data/epoch_samples_per_sec",
    "data/epoch_wait_fraction",
    "data/epoch_buckets",
}


def make_batch(
    batch_size: int, target: tuple[int, int, int], contexts: list[tuple[int, int, int]], text: int, **extra: int
) -> dict[str, Any]:
    """A batch shaped like `collate_image_edit` output, with one latent token per latent position."""
    target_tokens = target[1] * target[2]
    context_tokens = sum(h * w for _, h, w in contexts)
    return {
        "image_latents": torch.randn(batch_size, *target),
        "context_latents": [torch.randn(batch_size, *c) for c in contexts],
        "text_embeddings": torch.randn(batch_size, text, 6),
        "text_attention_mask": torch.ones(batch_size, text, dtype=torch.long),
        "conditioning_tensors": {},
        "data_type": "image",
        "metadata": {
            "batch_size": batch_size,
            "target_token_count": batch_size * target_tokens,
            "context_token_count": batch_size * context_tokens,
            "text_token_count": batch_size * text,
            "total_token_count": batch_size * (target_tokens + context_tokens + text),
            **extra,
        },
    }


def two_bucket_batches() -> list[dict[str, Any]]:
    """Five batches alternating A (2 samples, 128 latent + 3 text tokens each) and B (3 samples, 32 + 2)."""
    a = lambda **extra: make_batch(2, (4, 8, 8), [(4, 8, 8)], 3, **extra)  # noqa: E731
    b = lambda **extra: make_batch(3, (4, 4, 8), [], 2, **extra)  # noqa: E731
    return [a(), b(skipped=1), a(), b(), a(skipped=2)]


LATENT_PER_SAMPLE = {SIG_A: 128, SIG_B: 32}
TEXT_PER_SAMPLE = {SIG_A: 3, SIG_B: 2}


class SleepyBatches(Dataset):
    """Prebuilt batches, each fetched after `delay` seconds (a slow data pipeline)."""

    def __init__(self, batches: list[dict[str, Any]], delay: float) -> None:
        self.batches = batches
        self.delay = delay

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        time.sleep(self.delay)
        return self.batches[index]


def fit(
    monitor: ImageEditDataMonitor,
    tmp_path: Any,
    logger: Logger | bool,
    loader_delay: float = 0.0,
    step_delay: float = 0.0,
    epochs: int = 2,
) -> None:
    loader = DataLoader(SleepyBatches(two_bucket_batches(), loader_delay), batch_size=None)
    quiet_trainer(monitor, tmp_path, logger, epochs).fit(TinyModel(step_delay), train_dataloaders=loader)


def test_each_step_logs_rates_wait_and_bucket_id_under_the_prefix(tmp_path: Any) -> None:
    logger = RecordingLogger()
    monitor = ImageEditDataMonitor()
    fit(monitor, tmp_path, logger)
    steps = logger.data_records(STEP_METRICS)
    assert len(steps) == 10
    assert all(set(m) == STEP_METRICS for m in steps)
    assert [m["data/bucket_id"] for m in steps] == [0, 1, 0, 1, 0] * 2
    assert [m["data/skipped_samples"] for m in steps] == [0, 1, 0, 0, 2] * 2
    assert monitor.bucket_signatures == [SIG_A, SIG_B]
    assert monitor.last_signature == SIG_A
    assert [s for s, m in logger.records if set(m) & STEP_METRICS] == list(range(10))
    for m in steps:
        signature = monitor.bucket_signatures[int(m["data/bucket_id"])]
        assert m["data/samples_per_sec"] > 0
        latent_per_sample = m["data/latent_tokens_per_sec"] / m["data/samples_per_sec"]
        text_per_sample = m["data/text_tokens_per_sec"] / m["data/samples_per_sec"]
        assert latent_per_sample == pytest.approx(LATENT_PER_SAMPLE[signature])
        assert text_per_sample == pytest.approx(TEXT_PER_SAMPLE[signature])
        assert 0.0 <= m["data/wait_fraction"] <= 1.0


def test_epoch_summary_counts_batches_and_samples_per_bucket_exactly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    printed: list[str] = []
    monkeypatch.setattr(monitor_module, "rank_zero_info", printed.append)
    logger = RecordingLogger()
    monitor = ImageEditDataMonitor()
    fit(monitor, tmp_path, logger)
    assert [s["epoch"] for s in monitor.epoch_summaries] == [0, 1]
    for summary in monitor.epoch_summaries:
        assert (summary["batches"], summary["samples"], summary["skipped"]) == (5, 12, 3)
        assert summary["latent_tokens"] == 3 * 2 * 128 + 2 * 3 * 32
        assert 0.0 <= summary["wait_fraction"] <= 1.0
        assert [(b["bucket_id"], b["signature"], b["batches"], b["samples"]) for b in summary["buckets"]] == [
            (0, SIG_A, 3, 6),
            (1, SIG_B, 2, 6),
        ]
        assert [b["share"] for b in summary["buckets"]] == [0.5, 0.5]
    epochs = logger.data_records(EPOCH_METRICS)
    assert len(epochs) == 2
    assert all(set(m) == EPOCH_METRICS for m in epochs)
    assert [(m["data/epoch_batches"], m["data/epoch_samples"], m["data/epoch_buckets"]) for m in epochs] == [
        (5, 12, 2)
    ] * 2
    assert len(printed) == 2
    assert "5 batches, 12 samples, 3 skipped" in printed[0]
    assert SIG_A in printed[0] and SIG_B in printed[0]


def test_wait_fraction_is_higher_when_the_loader_sleeps(tmp_path: Any) -> None:
    def mean_wait(loader_delay: float) -> float:
        logger = RecordingLogger()
        fit(ImageEditDataMonitor(), tmp_path, logger, loader_delay=loader_delay, step_delay=0.005, epochs=1)
        waits = [m["data/wait_fraction"] for m in logger.data_records(STEP_METRICS)]
        assert all(0.0 <= w <= 1.0 for w in waits)
        return sum(waits) / len(waits)

    assert mean_wait(loader_delay=0.03) > mean_wait(loader_delay=0.0)


def test_without_a_logger_summaries_are_still_kept(tmp_path: Any) -> None:
    monitor = ImageEditDataMonitor()
    fit(monitor, tmp_path, logger=False)
    assert [(s["batches"], s["samples"]) for s in monitor.epoch_summaries] == [(5, 12), (5, 12)]
    assert monitor.last_bucket_id == 0


def test_log_every_n_steps_logs_windows_and_custom_prefix(tmp_path: Any) -> None:
    logger = RecordingLogger()
    fit(ImageEditDataMonitor(log_every_n_steps=2, prefix="io/"), tmp_path, logger)
    steps = [m for _, m in logger.records if "io/samples_per_sec" in m]
    # Batches A B A B A | A B A B A in windows of two: A+B holds 2*128 + 3*32 latent tokens over 5 samples,
    # and the window spanning the epoch boundary holds two A batches.
    mixed = (2 * 128 + 3 * 32) / 5
    ratios = [m["io/latent_tokens_per_sec"] / m["io/samples_per_sec"] for m in steps]
    assert ratios == pytest.approx([mixed, mixed, 128, mixed, mixed])
    assert [m["io/bucket_id"] for m in steps] == [1, 1, 0, 0, 0]
    assert not any(name.startswith("data/") for _, m in logger.records for name in m)


def test_wait_is_timed_from_the_previous_batch_end_and_excludes_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 3.0, 3.0, 10.0, 11.0, 12.0])
    monkeypatch.setattr(monitor_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    trainer: Any = SimpleNamespace(loggers=[], is_global_zero=True, current_epoch=0)
    module: Any = None
    monitor = ImageEditDataMonitor()
    a, b = two_bucket_batches()[:2]
    monitor.on_train_epoch_start(trainer, module)  # t=0
    monitor.on_train_batch_start(trainer, module, a, 0)  # t=1: waited 1
    monitor.on_train_batch_end(trainer, module, None, a, 0)  # t=3: step 3
    monitor.on_validation_start(trainer, module)  # t=3
    monitor.on_validation_end(trainer, module)  # t=10: 7 s not counted
    monitor.on_train_batch_start(trainer, module, b, 1)  # t=11: waited 1
    monitor.on_train_batch_end(trainer, module, None, b, 1)  # t=12: step 2
    monitor.on_train_epoch_end(trainer, module)
    assert monitor.epoch_summaries[0]["wait_fraction"] == pytest.approx((1 + 1) / (3 + 2))


def test_callback_reads_no_tensor_values(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    syncing = ("item", "tolist", "numpy", "cpu", "to", "__bool__", "__float__", "__int__", "__index__", "__format__")
    calls: list[str] = []

    def under_monitor() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == monitor_module.__file__:
                return True
            frame = frame.f_back
        return False

    for name in syncing:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if under_monitor():
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    # The spy itself works: a read made from code in monitor.py is caught.
    eval(compile("t.item()", monitor_module.__file__, "eval"), {"t": torch.ones(())})
    assert calls == ["item"]
    calls.clear()
    fit(ImageEditDataMonitor(), tmp_path, RecordingLogger())
    assert calls == []


def test_bucket_ids_survive_a_state_dict_round_trip() -> None:
    monitor = ImageEditDataMonitor()
    assert (monitor.bucket_id(SIG_A), monitor.bucket_id(SIG_B), monitor.bucket_id(SIG_A)) == (0, 1, 0)
    restored = ImageEditDataMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.bucket_id(SIG_B) == 1
    assert restored.bucket_id("target=1x1x1/contexts=[]") == 2
    with pytest.raises(ValueError, match="version: expected 1, got 7"):
        restored.load_state_dict({"version": 7, "bucket_signatures": []})


def test_log_every_n_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps: expected an integer >= 1, got 0"):
        ImageEditDataMonitor(log_every_n_steps=0)


class BucketRecordingModel(TinyModel):
    """Remembers the first sample index of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.first_samples: list[int] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.first_samples.append(batch["metadata"]["sample_indices"][0])
        return super().training_step(batch, batch_idx)


def test_bucket_id_is_the_index_bucket_id_of_the_batch_signature(tmp_path: Any) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(4, 6, 2))
    data = ImageEditDataModule(cache_dir=str(cache), batch_size=2, num_workers=0)
    logger, monitor, model = RecordingLogger(), ImageEditDataMonitor(), BucketRecordingModel()
    monitor.bucket_id("target=1x1x1/contexts=[]")  # ids seen before (or restored) give way to the index's
    quiet_trainer(monitor, tmp_path, logger, epochs=1).fit(model, datamodule=data)
    index = ImageEditDataset(cache).index
    assert monitor.bucket_signatures == [signature.describe() for signature in index.signatures]
    logged = [int(m["data/bucket_id"]) for m in logger.data_records(STEP_METRICS)]
    assert logged == [int(index.bucket_ids[i]) for i in model.first_samples]
    assert set(logged) == {0, 1, 2}
    for signature in index.signatures:
        assert monitor.bucket_id(signature.describe()) == index.signatures.index(signature)
