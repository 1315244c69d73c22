"""`image-edit-data fit|validate|test`: LightningCLI over `ImageEditDataModule` and any LightningModule."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from ..storage.secrets import OPTIONS, redacted, redacted_options
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


class RedactingParser(LightningArgumentParser):
    """Lightning's parser, dumping configs with the credentials in storage options and URLs redacted.

    `--print_config` and the `config.yaml` LightningCLI saves beside each run both come from `dump`.
    """

    def dump(self, cfg: Namespace, *args: Any, **kwargs: Any) -> str:
        return super().dump(redacted_namespace(cfg), *args, **kwargs)  # type: ignore[no-any-return]


def redacted_namespace(cfg: Namespace) -> Namespace:
    """A copy of a parsed config with every `storage_options` value, and every URL, redacted (`storage/secrets.py`)."""
    cfg = cfg.clone()
    for key in list(cfg.keys()):
        value = cfg[key]
        if key.rsplit(".", 1)[-1] == OPTIONS:
            cfg[key] = redacted_options(value)
        elif isinstance(value, str | list | dict):
            cfg[key] = redacted_tree(value)
    return cfg


def redacted_tree(value: Any) -> Any:
    """`redacted` for config values that may hold namespaces (a mixture's `sources`)."""
    if isinstance(value, Namespace):
        return redacted_namespace(value)
    if isinstance(value, list):
        return [redacted_tree(item) for item in value]
    return redacted(value)


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
        parser_class=RedactingParser,
        args=argv,
    )
