"""A one-parameter model, a logger that keeps what it is given, and a quiet one-device Trainer."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger

from image_edit_data.lightning.monitor import ImageEditDataMonitor


class RecordingLogger(Logger):
    """Keeps every `log_metrics` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def data_records(self, names: set[str]) -> list[dict[str, float]]:
        return [m for _, m in self.records if set(m) & names]


class TinyModel(pl.LightningModule):
    """One parameter; each step optionally sleeps to stand in for compute."""

    def __init__(self, step_delay: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.step_delay = step_delay

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_delay)
        return (self.weight * batch["image_latents"].mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def quiet_trainer(monitor: ImageEditDataMonitor, tmp_path: Any, logger: Logger | bool, epochs: int) -> pl.Trainer:
    """A one-device CPU Trainer that logs every step through `logger` and writes nothing else."""
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
