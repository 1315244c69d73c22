"""`ValidationEdits`: every N steps, edit a few fixed validation samples with the model being trained and show them.

Each sample of the validation cache (`data.val_cache_dir`) is edited from its cached prompt and context latents
as the diffusers pipeline would edit it (`edit_sampling.py`), decoded with the pipeline's VAE, and shown as one
image: context(s) | target | generated. The images go to every logger that takes images (TensorBoard's
`add_image`, or a `log_image` method such as Weights & Biases') and to PNG files; the mean squared distance
between generated and target latents, and the seconds the edits took, go to every logger (CSV included).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image

from image_edit_data import ImageEditDataset
from image_edit_data._atomic import atomic_writer
from image_edit_data.models.diffusers_check import model_directory
from image_edit_data.models.edit_sampling import decode_latents, generate_edit, unpack_latents

SEPARATOR = 4  # white pixels between the images of a grid


class ValidationEdits(pl.Callback):
    """Edit fixed validation samples every `every_n_train_steps` and log context | target | generated grids.

    Every rank runs the same edits (FSDP2 needs every rank in each forward); rank 0 writes and logs them.

    Args:
        pipeline_path: Local diffusers pipeline directory whose `scheduler/` and `vae/` are used; None takes the
            module's `model_path` when that is a pipeline directory.
        every_n_train_steps: Edit every this many optimizer steps; 0 turns the edits off.
        samples: How many validation samples, spread evenly over the validation cache, or their indices.
        num_inference_steps: Denoising steps per edit (the pipelines default to 50 for Qwen-Image-Edit, 28 for
            FLUX.1 Kontext).
        seed: Each edit starts from the noise `torch.Generator().manual_seed(seed)` gives the pipeline.
        before_training: Also edit before the first step (step 0), to see what the base model does.
        dirpath: Where the PNG files go (`step=N/sample=I.png`); None: `{trainer.default_root_dir}/validation_edits`.
    """

    def __init__(
        self,
        pipeline_path: str | None = None,
        every_n_train_steps: int = 500,
        samples: int | list[int] = 4,
        num_inference_steps: int = 28,
        seed: int = 0,
        before_training: bool = True,
        dirpath: str | None = None,
    ) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps: expected 0 (off) or more, got {every_n_train_steps}")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps: expected at least 1, got {num_inference_steps}")
        if isinstance(samples, int) and samples < 1:
            raise ValueError(f"samples: expected a count of at least 1 or a list of sample indices, got {samples}")
        self.pipeline_path = pipeline_path
        self.every_n_train_steps = every_n_train_steps
        self.samples = samples
        self.num_inference_steps = num_inference_steps
        self.seed = seed
        self.before_training = before_training
        self.dirpath = dirpath
        self.scheduler: Any = None
        self.vae: Any = None
        self.last_step = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check, before any weights load, that there is a pipeline directory and a validation cache."""
        if stage != "fit" or not self.every_n_train_steps:
            return
        self.pipeline_directory(pl_module)
        dataset(trainer)

    def pipeline_directory(self, pl_module: pl.LightningModule) -> Path:
        """The pipeline directory the scheduler and VAE come from; a clear error when there is none."""
        model_path = getattr(pl_module, "model_path", None)
        path = self.pipeline_path or (model_directory(model_path)[0] if model_path else None)
        if path is None or not (Path(path) / "model_index.json").is_file():
            raise ValueError(
                f"ValidationEdits: pipeline_path {path!r} is not a diffusers pipeline directory (no model_index.json); "
                "set the callback's pipeline_path to the local pipeline whose scheduler/ and vae/ the edits use"
            )
        return Path(path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_train_steps and self.before_training and trainer.global_step == 0:
            self.run(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step % self.every_n_train_steps == 0 and step != self.last_step:
            self.run(trainer, pl_module)

    def load(self, pl_module: Any) -> None:
        """Load the pipeline's scheduler and VAE once, the VAE in the transformer's dtype on its device."""
        import diffusers
        from packaging.version import Version

        path = self.pipeline_directory(pl_module)
        index = json.loads((path / "model_index.json").read_text())
        scheduler_class = getattr(diffusers, index["scheduler"][1])
        self.scheduler = scheduler_class.from_pretrained(path, subfolder="scheduler", local_files_only=True)
        vae_class = getattr(diffusers, index["vae"][1])
        dtype_key = "dtype" if Version(diffusers.__version__) >= Version("0.40") else "torch_dtype"
        options = {dtype_key: pl_module.weight_dtype, "local_files_only": True}
        self.vae = vae_class.from_pretrained(path, subfolder="vae", **options)
        self.vae.to(pl_module.device).eval().requires_grad_(False)

    def run(self, trainer: pl.Trainer, pl_module: Any) -> None:
        """Edit every chosen sample, then write and log the grids (rank 0)."""
        step = trainer.global_step
        self.last_step = step
        if self.scheduler is None:
            self.load(pl_module)
        data = dataset(trainer)
        if len(data) == 0:
            rank_zero_warn("ValidationEdits: the validation cache has no samples; no edits are shown")
            return
        started = time.perf_counter()
        grids, distances = [], []
        was_training = pl_module.transformer.training
        pl_module.transformer.eval()  # adapter dropout off, as at inference
        try:
            with trainer.precision_plugin.forward_context():
                for index in self.indices(len(data)):
                    sample = data[index]
                    generator = torch.Generator().manual_seed(self.seed)
                    tokens = generate_edit(pl_module, sample, self.scheduler, generator, self.num_inference_steps)
                    grid, distance = self.grid(sample, tokens)
                    grids.append((index, grid))
                    distances.append(distance)
        finally:
            pl_module.transformer.train(was_training)
        seconds = time.perf_counter() - started
        if trainer.is_global_zero:
            self.publish(trainer, step, grids, float(np.mean(distances)), seconds)

    def indices(self, size: int) -> list[int]:
        """The validation samples to edit: the given indices, or `samples` spread evenly over the cache."""
        if isinstance(self.samples, int):
            count = min(self.samples, size)
            return sorted({int(i) for i in np.linspace(0, size - 1, count).round()})
        bad = [i for i in self.samples if not 0 <= i < size]
        if bad:
            raise ValueError(f"ValidationEdits: samples {bad} are outside the validation cache's {size} samples")
        return list(self.samples)

    def grid(self, sample: Any, tokens: torch.Tensor) -> tuple[np.ndarray, float]:
        """Context(s) | target | generated as one uint8 image, and the generated-to-target latent distance."""
        _, height, width = sample["target_latent"].shape
        generated = unpack_latents(tokens.float(), height, width).cpu()
        target = sample["target_latent"][None].float()
        distance = torch.mean((generated - target) ** 2).item()
        latents = [c[None] for c in sample["context_latents"]] + [target, generated]
        images = [decode_latents(self.vae, z) for z in latents]
        return side_by_side(images), distance

    def publish(
        self, trainer: pl.Trainer, step: int, grids: list[tuple[int, np.ndarray]], mse: float, seconds: float
    ) -> None:
        """PNG files, images to the loggers that take them, the latent distance and time to every logger."""
        folder = Path(self.dirpath or Path(trainer.default_root_dir) / "validation_edits") / f"step={step}"
        for index, grid in grids:
            with atomic_writer(folder / f"sample={index}.png") as stream:
                Image.fromarray(grid).save(stream, format="PNG")
        metrics = {"val_edits/latent_mse": mse, "val_edits/seconds": seconds}
        for logger in trainer.loggers:
            experiment: Any = getattr(logger, "experiment", None)
            for index, grid in grids:
                tag = f"val_edits/sample={index}"
                if hasattr(experiment, "add_image"):  # TensorBoard
                    experiment.add_image(tag, grid, global_step=step, dataformats="HWC")
                elif hasattr(logger, "log_image"):  # Weights & Biases, Neptune, ...
                    logger.log_image(key=tag, images=[Image.fromarray(grid)], step=step)
            logger.log_metrics(metrics, step=step)


def dataset(trainer: pl.Trainer) -> ImageEditDataset:
    """The datamodule's validation dataset; a clear error when there is none."""
    data = getattr(getattr(trainer, "datamodule", None), "val_dataset", None)
    if not isinstance(data, ImageEditDataset):
        raise ValueError(
            "ValidationEdits: no validation cache; set data.val_cache_dir (or set the callback's "
            "every_n_train_steps to 0 to turn the edits off)"
        )
    return data


def side_by_side(images: list[torch.Tensor]) -> np.ndarray:
    """Images `[3, h, w]` in [0, 1] in one row on white, top-aligned: uint8 `[H, W, 3]`."""
    height = max(image.shape[1] for image in images)
    width = sum(image.shape[2] for image in images) + SEPARATOR * (len(images) - 1)
    canvas = np.full((height, width, 3), 255, dtype=np.uint8)
    x = 0
    for image in images:
        pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        canvas[: pixels.shape[0], x : x + pixels.shape[1]] = pixels
        x += pixels.shape[1] + SEPARATOR
    return canvas
