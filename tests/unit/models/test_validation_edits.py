"""Claims about validation: the fixed-noise flow loss, and edits generated exactly as the diffusers pipelines do."""

from __future__ import annotations

import contextlib
import csv
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from PIL import Image
from support.lora import complete_pipeline, load_pipeline, pipeline_module, random_cache, randomize_adapter

from image_edit_data import ImageEditDataModule
from image_edit_data.models.edit_sampling import generate_edit, unpack_latents
from image_edit_data.models.lora_export import export_module
from image_edit_data.models.validation_edits import ValidationEdits
from image_edit_data.models.validation_loss import fixed_noise

pytestmark = pytest.mark.usefixtures("one_thread")
diffusers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen-Image-Edit-Plus and FLUX.1 Kontext pipelines, transformers and released schedulers included."""
    root = tmp_path_factory.mktemp("pipelines")
    return {arch: complete_pipeline(arch, root / arch) for arch in ("qwen", "kontext")}


def trained_module(arch: str, path: Path) -> Any:
    """The pipeline's own transformer with a random (nonzero) rank-4 adapter: a model partway through training."""
    module = pipeline_module(arch, model_path=str(path), lora=True, lora_rank=4)
    module.configure_model()
    randomize_adapter(module, scale=0.2)
    return module


def qwen_pipeline_inputs(pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, dict[str, Any]]:
    """QwenImageEditPlusPipeline's output latents for one edit, and the sample its transformer was given."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    # The pipeline sizes condition images for the VAE at 1024 x 1024 pixels; the tiny VAE downsamples by 2, not 8,
    # so that would be 65,536 tokens: 32 x 32 keeps the test small and the code path the same.
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", 32 * 32)
    context = Image.fromarray((np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8))
    seen: dict[str, Any] = {}
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.setdefault("inputs", kwargs) and None, with_kwargs=True
    )
    try:
        output = pipeline(
            image=[context], prompt="make the sky red", height=32, width=32, num_inference_steps=4,
            generator=torch.Generator().manual_seed(5), output_type="latent",
        ).images  # fmt: skip
    finally:
        hook.remove()
    inputs = seen["inputs"]
    (_, rows, cols), (_, context_rows, context_cols) = inputs["img_shapes"][0]
    context_latents = unpack_latents(inputs["hidden_states"][:, rows * cols :], 2 * context_rows, 2 * context_cols)
    prompt = inputs["encoder_hidden_states"][0]
    assert inputs["encoder_hidden_states_mask"] is None, "every prompt token is real, so the pipeline passes no mask"
    sample = {
        "target_latent": torch.zeros(4, 2 * rows, 2 * cols),
        "context_latents": [context_latents[0]],
        "prompt_embeddings": prompt,
        "prompt_attention_mask": torch.ones(prompt.shape[0], dtype=torch.long),
        "conditioning_tensors": {},
    }
    return output, sample


def kontext_pipeline_inputs(pipeline: Any, guidance_scale: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """FluxKontextPipeline's output latents for one edit given cached-style inputs (it takes latents as `image`)."""
    g = torch.Generator().manual_seed(3)
    prompt, pooled, context = (
        torch.randn(1, 7, 16, generator=g),
        torch.randn(1, 24, generator=g),
        torch.randn(1, 4, 8, 6),
    )
    output = pipeline(
        image=context, prompt_embeds=prompt, pooled_prompt_embeds=pooled, height=20, width=16, max_area=20 * 16,
        _auto_resize=False, num_inference_steps=4, guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(5), output_type="latent",
    ).images  # fmt: skip
    sample = {
        "target_latent": torch.zeros(4, 10, 8),
        "context_latents": [context[0]],
        "prompt_embeddings": prompt[0],
        "prompt_attention_mask": torch.ones(7, dtype=torch.long),
        "conditioning_tensors": {"pooled_prompt_embeds": pooled[0]},
    }
    return output, sample


@pytest.mark.parametrize("arch", ["qwen", "kontext"])
def test_a_validation_edit_equals_the_pipelines_own_output_for_the_same_inputs_and_seed(
    arch: str, pipelines: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = trained_module(arch, pipelines[arch])
    pipeline = load_pipeline(arch, pipelines[arch])
    pipeline.transformer = module.transformer  # the model being trained, adapter included
    if arch == "qwen":
        expected, sample = qwen_pipeline_inputs(pipeline, monkeypatch)
    else:
        expected, sample = kontext_pipeline_inputs(pipeline, module.guidance_scale)
    assert pipeline.scheduler.config.use_dynamic_shifting, "the released schedulers shift by the image's token count"
    edited = generate_edit(module, sample, pipeline.scheduler, torch.Generator().manual_seed(5), 4)
    # One process, one thread, the same shapes and kernels: the same float operations, so exactly equal.
    assert torch.equal(edited, expected)
    other_seed = generate_edit(module, sample, pipeline.scheduler, torch.Generator().manual_seed(6), 4)
    assert not torch.equal(other_seed, expected)


@contextlib.contextmanager
def diffusers_log() -> Iterator[list[str]]:
    """The messages diffusers logs inside the block (its loggers do not propagate to the root logger)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("arch", ["qwen", "kontext"])
def test_an_exported_adapter_loads_into_the_pipeline_as_users_load_it_and_edits_like_the_trained_module(
    arch: str, pipelines: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Alpha twice the rank: an export that lost the adapter's scale would edit differently.
    module = pipeline_module(arch, model_path=str(pipelines[arch]), lora=True, lora_rank=4, lora_alpha=8)
    module.configure_model()
    randomize_adapter(module, scale=0.2)
    export_module(module, tmp_path / "adapter", dtype="float32")
    pipeline = load_pipeline(arch, pipelines[arch])  # Pipeline.from_pretrained(base), as users load it
    with diffusers_log() as logged:
        pipeline.load_lora_weights(tmp_path / "adapter")
    if arch == "kontext":  # docs/lora.md: the harmless line a Kontext adapter (transformer only) logs
        assert any("No LoRA keys associated to CLIPTextModel" in line for line in logged), logged

    def pipeline_edit() -> tuple[torch.Tensor, dict[str, Any]]:
        if arch == "qwen":
            return qwen_pipeline_inputs(pipeline, monkeypatch)
        return kontext_pipeline_inputs(pipeline, module.guidance_scale)

    loaded, sample = pipeline_edit()
    edited = generate_edit(module, sample, pipeline.scheduler, torch.Generator().manual_seed(5), 4)
    pipeline.disable_lora()
    base, _ = pipeline_edit()
    # The module's edit equals its pipeline's (the test above), so this means the same adapter, scale and targets,
    # with no conversion. Not bit-equal: weights read from the file sit at other memory alignments than the
    # module's, and the BLAS kernels then round sums differently (~1e-7).
    torch.testing.assert_close(loaded, edited, rtol=1e-5, atol=1e-5)
    assert (base - loaded).abs().max() > 0.1, "the adapter changes the edit far beyond the rounding allowed above"


def validation_metrics(module: Any, cache: Path, batch_size: int, tmp_path: Path) -> dict[str, float]:
    """`trainer.validate` on `cache` as the validation set: the logged metrics."""
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    datamodule = ImageEditDataModule(str(cache), batch_size, val_cache_dir=str(cache), num_workers=0)
    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    return metrics


def test_the_validation_loss_uses_the_same_noise_and_levels_in_every_run_and_for_any_batch_size(tmp_path: Path) -> None:
    # Qwen masks the prompt padding, so how prompts of different lengths are batched does not matter (FLUX.1
    # attends to its padding; Kontext caches pad every prompt to the same length).
    cache = random_cache(tmp_path / "val", "qwen", samples=4, contexts=2)
    module = pipeline_module("qwen", lora=True, lora_rank=4, val_sigmas=(0.2, 0.8))
    first = validation_metrics(module, cache, 2, tmp_path)
    assert validation_metrics(module, cache, 2, tmp_path) == first, "a second run measures exactly the same"
    # Batches of 1 average the same per-sample losses in another order: equal up to float rounding.
    assert validation_metrics(module, cache, 1, tmp_path) == pytest.approx(first, rel=1e-6)
    assert set(first) == {"val/loss", "val/loss_at_0.2", "val/loss_at_0.8"}
    assert first["val/loss"] == pytest.approx((first["val/loss_at_0.2"] + first["val/loss_at_0.8"]) / 2)
    assert first["val/loss_at_0.2"] != first["val/loss_at_0.8"]
    alone, together = fixed_noise((4, 2, 2), [5], seed=0), fixed_noise((4, 2, 2), [3, 5], seed=0)
    assert torch.equal(alone[0], together[1]), "a sample's noise does not depend on its batch"
    with pytest.raises(ValueError, match=r"val_sigmas: expected one or more noise levels in \(0, 1\], got \[0\.0\]"):
        pipeline_module("kontext", val_sigmas=(0.0,))


class ImageRecorder(Logger):
    """A logger like Weights & Biases': it has `log_image` (and no TensorBoard experiment); it remembers the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, int | None, tuple[int, ...]]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_image(self, key: str, images: list[Image.Image], step: int | None = None) -> None:
        self.images += [(key, step, np.asarray(image).shape) for image in images]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def tensorboard_images(log_dir: str) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Every image in a TensorBoard run: tag -> (step, pixels), read back from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    return {
        tag: [(e.step, np.asarray(Image.open(io.BytesIO(e.encoded_image_string)))) for e in events.Images(tag)]
        for tag in events.Tags()["images"]
    }


def fit_with_edits(tmp_path: Path, pipeline: Path, edits: ValidationEdits, loggers: list[Logger], val: Path | None):
    """Fit 4 steps of a Kontext LoRA on random data with the `edits` callback."""
    train = random_cache(tmp_path / "train", "kontext", samples=4)
    module = pipeline_module("kontext", lora=True, lora_rank=4, learning_rate=1e-2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=loggers or False, callbacks=[edits],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    datamodule = ImageEditDataModule(str(train), 2, val_cache_dir=str(val) if val else None, num_workers=0)
    trainer.fit(module, datamodule=datamodule)
    return trainer


def test_validation_edits_show_context_target_and_generated_as_png_files_logged_images_and_metrics(
    tmp_path: Path, pipelines: dict[str, Path]
) -> None:
    val = random_cache(tmp_path / "val", "kontext", samples=5, contexts=2)
    edits = ValidationEdits(
        pipeline_path=str(pipelines["kontext"]), every_n_train_steps=2, samples=2, num_inference_steps=2,
        dirpath=str(tmp_path / "edits"),
    )  # fmt: skip
    board, table, images = TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv"), ImageRecorder()
    fit_with_edits(tmp_path, pipelines["kontext"], edits, [board, table, images], val)

    # Samples 0 and 4 (spread over the 5), before training and after steps 2 and 4.
    written = sorted(str(p.relative_to(tmp_path / "edits")) for p in (tmp_path / "edits").rglob("*.png"))
    assert written == [f"step={s}/sample={i}.png" for s in (0, 2, 4) for i in (0, 4)]
    # Two contexts, the target, the generated edit: 4x4 latents decode to 8x8 images, 4 white pixels apart.
    grid = np.asarray(Image.open(tmp_path / "edits" / "step=4" / "sample=4.png"))
    assert grid.shape == (8, 4 * 8 + 3 * 4, 3)
    assert (grid[:, 8:12] == 255).all() and not (grid[:, :8] == 255).all()
    logged_images = tensorboard_images(board.log_dir)
    assert sorted(logged_images) == ["val_edits/sample=0", "val_edits/sample=4"]
    assert [step for step, _ in logged_images["val_edits/sample=4"]] == [0, 2, 4]
    assert np.array_equal(logged_images["val_edits/sample=4"][-1][1], grid), "TensorBoard shows the PNG file's grid"
    assert images.images == [(f"val_edits/sample={i}", s, (8, 44, 3)) for s in (0, 2, 4) for i in (0, 4)]
    with open(Path(table.log_dir) / "metrics.csv") as metrics:
        rows = list(csv.DictReader(metrics))
    logged = [(int(r["step"]), float(r["val_edits/latent_mse"])) for r in rows if r.get("val_edits/latent_mse")]
    assert [step for step, _ in logged] == [0, 2, 4]
    assert all(mse > 0 for _, mse in logged)
    assert all(float(r["val_edits/seconds"]) > 0 for r in rows if r.get("val_edits/seconds"))


def test_validation_edits_turn_off_and_refuse_a_missing_pipeline_or_validation_cache(
    tmp_path: Path, pipelines: dict[str, Path]
) -> None:
    off = ValidationEdits(every_n_train_steps=0, dirpath=str(tmp_path / "edits"))
    assert fit_with_edits(tmp_path / "off", pipelines["kontext"], off, [], None).global_step == 4
    assert not (tmp_path / "edits").exists()
    no_pipeline = ValidationEdits(every_n_train_steps=2)
    with pytest.raises(ValueError, match=r"pipeline_path None is not a diffusers pipeline directory"):
        fit_with_edits(tmp_path / "a", pipelines["kontext"], no_pipeline, [], random_cache(tmp_path / "v", "kontext"))
    no_val = ValidationEdits(pipeline_path=str(pipelines["kontext"]), every_n_train_steps=2)
    with pytest.raises(ValueError, match=r"no validation cache; set data\.val_cache_dir"):
        fit_with_edits(tmp_path / "b", pipelines["kontext"], no_val, [], None)
    with pytest.raises(ValueError, match=r"samples \[9\] are outside the validation cache's 4 samples"):
        ValidationEdits(samples=[9]).indices(4)
