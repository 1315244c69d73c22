"""A Lightning callback that reports throughput, the time spent waiting for data, and the bucket mix.

Per training batch it reads only tensor shapes and the plain-int counts in `batch["metadata"]`
(no `.item()`, no device sync) and times the gap before `on_train_batch_start` against the whole
step with `time.perf_counter`. Rank 0 logs the numbers through the trainer's loggers; at each
train epoch end every rank keeps a per-bucket summary and rank 0 prints it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from ..contract.batch import EDIT_MASK
from ..contract.signature import Signature

STATE_VERSION = 1


@dataclass
class _Tally:
    """Sums over a span of training batches; rates and the wait fraction are derived from them."""

    batches: int = 0
    samples: int = 0
    skipped: int = 0
    latent_tokens: int = 0
    text_tokens: int = 0
    wait_seconds: float = 0.0
    step_seconds: float = 0.0

    def add(self, metadata: Mapping[str, Any], wait_seconds: float, step_seconds: float) -> None:
        """Count one batch from its collate metadata and its timings."""
        self.batches += 1
        self.samples += metadata["batch_size"]
        self.skipped += metadata.get("skipped", 0)
        self.latent_tokens += metadata["target_token_count"] + metadata["context_token_count"]
        self.text_tokens += metadata["text_token_count"]
        self.wait_seconds += wait_seconds
        self.step_seconds += step_seconds

    def per_second(self, count: int) -> float:
        """`count` over the summed step time (0.0 before any time has been measured)."""
        return count / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of step time spent waiting for data: summed waits over summed step times."""
        return self.wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


def _batch_signature(batch: Mapping[str, Any]) -> str:
    """The batch's bucket key (`Signature.describe()`), read from latent shapes and whether it carries edit masks."""
    target = tuple(batch["image_latents"].shape[1:])
    contexts = tuple(tuple(c.shape[1:]) for c in batch["context_latents"])
    masked = EDIT_MASK in batch.get("conditioning_tensors", {})
    return Signature(target, contexts, masked).describe()  # type: ignore[arg-type]


class ImageEditDataMonitor(Callback):
    """Logs data throughput, data-wait fraction and bucket id per training step; summarises buckets per epoch.

    Step metrics (names after `prefix`): `samples_per_sec`, `latent_tokens_per_sec` (target +
    context), `text_tokens_per_sec`, `wait_fraction`, `bucket_id`, `skipped_samples`. Epoch
    metrics: `epoch_batches`, `epoch_samples`, `epoch_skipped_samples`, `epoch_samples_per_sec`,
    `epoch_wait_fraction`, `epoch_buckets`. Bucket ids are the index's (`ImageEditDataset.signatures`
    order) when the training loader's dataset is an image-edit cache; for other data they number
    signatures in order of first appearance. `bucket_signatures[id]` maps back.
    """

    def __init__(self, log_every_n_steps: int = 1, prefix: str = "data/") -> None:
        """
        Args:
            log_every_n_steps: log every this many training batches; rates and the wait fraction
                cover all batches since the last log, `bucket_id` is the last batch's.
            prefix: prepended to every metric name.
        """
        super().__init__()
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps: expected an integer >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.bucket_signatures: list[str] = []
        self.last_signature: str | None = None
        self.last_bucket_id: int | None = None
        self.epoch_summaries: list[dict[str, Any]] = []
        self._bucket_ids: dict[str, int] = {}
        self._window = _Tally()
        self._epoch = _Tally()
        self._epoch_buckets: dict[int, _Tally] = {}
        self._last_end: float | None = None
        self._batch_start: float | None = None
        self._validation_start: float | None = None

    def bucket_id(self, signature: str) -> int:
        """The stable id of `signature`, assigning the next one on first sight."""
        if signature not in self._bucket_ids:
            self._bucket_ids[signature] = len(self.bucket_signatures)
            self.bucket_signatures.append(signature)
        return self._bucket_ids[signature]

    def use_index(self, signatures: Sequence[Signature]) -> None:
        """Number buckets as the cache index does: bucket `id` is `signatures[id]`."""
        self.bucket_signatures = [signature.describe() for signature in signatures]
        self._bucket_ids = {signature: i for i, signature in enumerate(self.bucket_signatures)}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        signatures = getattr(getattr(trainer.train_dataloader, "dataset", None), "signatures", None)
        if signatures is not None:  # the loader reads an image-edit cache: take its index's bucket ids
            self.use_index(signatures)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = time.perf_counter()
        self._epoch = _Tally()
        self._epoch_buckets = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is None or self._batch_start is None:
            return  # hooks out of order (Lightning's fit loop never does this): nothing sound to time
        wait, step = self._batch_start - self._last_end, now - self._last_end
        self._last_end, self._batch_start = now, None
        signature = _batch_signature(batch)
        bucket_id = self.bucket_id(signature)
        self.last_signature, self.last_bucket_id = signature, bucket_id
        metadata = batch["metadata"]
        for tally in (self._window, self._epoch, self._epoch_buckets.setdefault(bucket_id, _Tally())):
            tally.add(metadata, wait, step)
        if self._window.batches >= self.log_every_n_steps:
            window, self._window = self._window, _Tally()
            self._log(
                trainer,
                {
                    "samples_per_sec": window.per_second(window.samples),
                    "latent_tokens_per_sec": window.per_second(window.latent_tokens),
                    "text_tokens_per_sec": window.per_second(window.text_tokens),
                    "wait_fraction": window.wait_fraction,
                    "bucket_id": bucket_id,
                    "skipped_samples": window.skipped,
                },
            )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation inside a training epoch runs between two training batches; it is not data wait.
        if self._last_end is not None and self._validation_start is not None:
            self._last_end += time.perf_counter() - self._validation_start
        self._validation_start = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self._summary(trainer.current_epoch)
        self.epoch_summaries.append(summary)
        rank_zero_info(_format_summary(summary))
        epoch = self._epoch
        self._log(
            trainer,
            {
                "epoch_batches": epoch.batches,
                "epoch_samples": epoch.samples,
                "epoch_skipped_samples": epoch.skipped,
                "epoch_samples_per_sec": epoch.per_second(epoch.samples),
                "epoch_wait_fraction": epoch.wait_fraction,
                "epoch_buckets": len(self._epoch_buckets),
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "bucket_signatures": list(self.bucket_signatures)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"ImageEditDataMonitor state: version: expected {STATE_VERSION}, got {state_dict.get('version')!r}"
            )
        self.bucket_signatures = list(state_dict["bucket_signatures"])
        self._bucket_ids = {signature: i for i, signature in enumerate(self.bucket_signatures)}

    def _summary(self, epoch: int) -> dict[str, Any]:
        """This epoch's totals and per-bucket counts (buckets in id order; share is of samples)."""
        total = self._epoch
        buckets = [
            {
                "bucket_id": bucket_id,
                "signature": self.bucket_signatures[bucket_id],
                "batches": tally.batches,
                "samples": tally.samples,
                "share": tally.samples / total.samples if total.samples else 0.0,
            }
            for bucket_id, tally in sorted(self._epoch_buckets.items())
        ]
        return {
            "epoch": epoch,
            "batches": total.batches,
            "samples": total.samples,
            "skipped": total.skipped,
            "latent_tokens": total.latent_tokens,
            "text_tokens": total.text_tokens,
            "wait_fraction": total.wait_fraction,
            "buckets": buckets,
        }

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        """Send metrics to every logger from rank 0; a trainer without loggers gets nothing."""
        if not trainer.loggers or not trainer.is_global_zero:
            return
        # Lightning's own `self.log` uses this step, so these curves line up with the loss.
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        named = {self.prefix + name: value for name, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(named, step=step)


def _format_summary(summary: Mapping[str, Any]) -> str:
    """A short text table of one epoch summary: totals, then one row per bucket."""
    lines = [
        f"data epoch {summary['epoch']}: {summary['batches']} batches, {summary['samples']} samples, "
        f"{summary['skipped']} skipped, waiting for data {summary['wait_fraction']:.1%} of step time",
        f"{'id':>4} {'batches':>8} {'samples':>8} {'share':>6}  signature",
    ]
    lines += [
        f"{b['bucket_id']:>4} {b['batches']:>8} {b['samples']:>8} {b['share']:>6.1%}  {b['signature']}"
        for b in summary["buckets"]
    ]
    return "\n".join(lines)
