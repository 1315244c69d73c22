"""`image-edit-data fit|validate|test`: LightningCLI over `ImageEditDataModule` and any LightningModule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from .datamodule import ImageEditDataModule


class RunReport(pl.Callback):
    """Remembers the first and the latest training loss and says where the run wrote its files."""

    def __init__(self, metric: str = "train/loss") -> None:
        self.metric = metric
        self.first: torch.Tensor | None = None
        self.latest: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if value is not None:
            # Keep tensors, not floats: converting every step would force a device sync.
            self.latest = value.detach().clone()
            if self.first is None:
                self.first = self.latest

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lines = []
        if self.first is not None and self.latest is not None:
            lines.append(f"{self.metric}: first {self.first.item():.4f}, final {self.latest.item():.4f}")
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"logs: {trainer.logger.log_dir}")
        checkpoint_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
        if checkpoint_dir:
            lines.append(f"checkpoints: {checkpoint_dir} (resume with --ckpt_path last)")
        for line in lines:
            rank_zero_info(line)


class ImageEditCLI(LightningCLI):
    """LightningCLI with our DataModule; the model class comes from the config (`model.class_path`)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(RunReport, "run_report")


def lightning_main(argv: list[str] | None) -> None:
    """Run a LightningCLI subcommand (`fit`, `validate`, `test`); `argv` after the program name, or sys.argv."""
    # The DataModule's data options are the fields of ImageEditDataloaderConfig, documented by attribute docstrings.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    ImageEditCLI(
        model_class=pl.LightningModule,
        subclass_mode_model=True,
        datamodule_class=ImageEditDataModule,
        # A resumed run writes into the same directory as the run it continues.
        save_config_kwargs={"overwrite": True},
        args=argv,
    )
