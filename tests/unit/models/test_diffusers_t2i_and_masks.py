"""The real-architecture modules on text-to-image batches (no context tokens) and masked batches (weighted loss)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from support.caches import make_payload, write_cache
from support.diffusers_fit import tiny_module

from image_edit_data import ImageEditDataModule
from image_edit_data.contract import EDIT_MASK
from image_edit_data.models.diffusers_edit import DiffusersEditModule
from image_edit_data.models.diffusers_inputs import pack_latents, packed_grids, step_generator

CHANNELS, TEXT, POOLED = 16, 32, 16  # what the tiny configs' transformers take
Shape = tuple[int, int, int]

pytestmark = pytest.mark.usefixtures("one_thread")


def cache_of(root: Path, buckets: Sequence[tuple[Shape, tuple[Shape, ...], torch.Tensor | None, int]]) -> Path:
    """`count` random samples per `(target, contexts, mask or None, count)`; prompts 3..6 tokens long."""
    payloads = []
    for target, contexts, mask, count in buckets:
        for _ in range(count):
            i = len(payloads)
            g = torch.Generator().manual_seed(i)
            conditioning = {"pooled_prompt_embeds": torch.randn(POOLED, generator=g)}
            if mask is not None:
                conditioning[EDIT_MASK] = mask
            payload = make_payload(i, target, contexts, sequence=3 + i % 4, hidden=TEXT, conditioning=conditioning)
            payload["target_latent"] = torch.randn(target, generator=g)
            payload["context_latents"] = [torch.randn(c, generator=g) for c in contexts]
            if mask is not None:
                payload["metadata"]["compound_bucket_signature"]["mask"] = True
            payloads.append(payload)
    return write_cache(root, payloads)


def first_batch(cache: Path, batch_size: int = 2) -> dict[str, Any]:
    """The first training batch of `cache` as the DataModule delivers it."""
    datamodule = ImageEditDataModule(cache_dir=str(cache), batch_size=batch_size, num_workers=0, pin_memory=False)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


class TransformerCalls:
    """Records the keyword arguments and the output of every call of a transformer while in a `with` block."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self.inputs: list[dict[str, Any]] = []
        self.outputs: list[torch.Tensor] = []

    def __enter__(self) -> TransformerCalls:
        self.hooks = [
            self.transformer.register_forward_pre_hook(
                lambda _m, _a, kw: self.inputs.append(dict(kw)), with_kwargs=True
            ),
            self.transformer.register_forward_hook(lambda _m, _a, out: self.outputs.append(out[0].detach())),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()


# Text-to-image batches: the transformer gets what diffusers' text-to-image pipeline gives it.

TARGET: Shape = (CHANNELS, 8, 6)  # 4 x 3 tokens; 64 x 48 pixels at the pipelines' VAE factor 8


@pytest.fixture(scope="module")
def text_to_image_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cache_of(tmp_path_factory.mktemp("t2i"), [(TARGET, (), None, 2)])


def text_to_image_pipeline_call(arch: str, model: DiffusersEditModule, batch: dict[str, Any]) -> TransformerCalls:
    """One denoising step of diffusers' text-to-image pipeline (`QwenImagePipeline` / `FluxPipeline`) on `model`'s
    transformer, with the batch's prompt embeddings and the target's size, recording the transformer's call."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, QwenImagePipeline

    size = {"height": TARGET[1] * 8, "width": TARGET[2] * 8, "num_inference_steps": 1, "output_type": "latent"}
    with TransformerCalls(model.transformer) as calls, torch.no_grad():
        if arch == "qwen":
            pipeline: Any = QwenImagePipeline(
                FlowMatchEulerDiscreteScheduler(),
                None,
                None,
                None,
                model.transformer,  # no VAE or text encoder
            )
            pipeline(prompt_embeds=batch["text_embeddings"], prompt_embeds_mask=batch["text_attention_mask"], **size)
        else:
            pipeline = FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, model.transformer)
            pooled = batch["conditioning_tensors"]["pooled_prompt_embeds"]
            pipeline(
                prompt_embeds=batch["text_embeddings"],
                pooled_prompt_embeds=pooled,
                guidance_scale=model.guidance_scale,
                **size,
            )
    return calls


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_a_text_to_image_batch_gives_the_transformer_no_context_tokens_and_the_pipelines_inputs(
    arch: str, text_to_image_cache: Path
) -> None:
    model = tiny_module(arch)
    model.configure_model()
    batch = first_batch(text_to_image_cache)
    assert batch["context_latents"] == []
    with TransformerCalls(model.transformer) as ours:
        model.flow_loss(batch, step_generator(torch.device("cpu"), 0))
    theirs = text_to_image_pipeline_call(arch, model, batch)
    mine, pipelines = ours.inputs[0], theirs.inputs[0]
    # No context tokens: only the target's 4 x 3 tokens, as the pipeline's latents.
    assert mine["hidden_states"].shape == pipelines["hidden_states"].shape == (2, 12, 4 * CHANNELS)
    assert torch.equal(mine["encoder_hidden_states"], pipelines["encoder_hidden_states"])
    if arch == "qwen":
        assert mine["img_shapes"] == pipelines["img_shapes"] == [[(1, 4, 3)]] * 2
    else:
        assert torch.equal(mine["img_ids"], pipelines["img_ids"]) and mine["img_ids"][:, 0].eq(0).all()
        assert torch.equal(mine["txt_ids"], pipelines["txt_ids"])
        assert torch.equal(mine["pooled_projections"], pipelines["pooled_projections"])
        assert torch.equal(mine["guidance"], pipelines["guidance"])
    # Given the pipeline's noisy latents and time, the module's call predicts what the pipeline's call predicted.
    grids = packed_grids(batch["image_latents"], batch["context_latents"])
    with torch.no_grad():
        again = model.predict(pipelines["hidden_states"], pipelines["timestep"], batch, grids)
    torch.testing.assert_close(again, theirs.outputs[0], rtol=1e-5, atol=1e-6)


# Masked batches: the flow loss weighted per latent cell.

MASKED: Shape = (CHANNELS, 8, 8)  # 4 x 4 tokens


def region_mask() -> torch.Tensor:
    """Edited: the left half (token columns 0 and 1), one cell there at 0.5; the right half is outside."""
    mask = torch.zeros(8, 8)
    mask[:, :4] = 1.0
    mask[3, 1] = 0.5
    return mask


@pytest.fixture(scope="module")
def masked_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cache_of(tmp_path_factory.mktemp("masked"), [(MASKED, ((CHANNELS, 4, 4),), region_mask(), 2)])


def hand_weighted_loss(calls: TransformerCalls, x0: torch.Tensor, mask: torch.Tensor, outside: float) -> float:
    """The weighted flow loss from the transformer's recorded input and output, element by element.

    The velocity target `noise - x0` is recovered from the noisy tokens `(1 - s) x0 + s noise` the transformer
    got; a token `(r, c)` holds, at `k * 4 + dy * 2 + dx`, channel k of latent cell `(2r + dy, 2c + dx)`.
    """
    inputs, pred = calls.inputs[0], calls.outputs[0].double()
    batch, channels, height, width = x0.shape
    tokens = (height // 2) * (width // 2)
    s = inputs["timestep"].double()[:, None, None]
    packed_x0 = pack_latents(x0.double())
    velocity = (inputs["hidden_states"][:, :tokens].double() - (1 - s) * packed_x0) / s - packed_x0
    losses = []
    for b in range(batch):
        total = weight_sum = 0.0
        for r in range(height // 2):
            for c in range(width // 2):
                for k in range(channels):
                    for dy in range(2):
                        for dx in range(2):
                            m = float(mask[b, 2 * r + dy, 2 * c + dx])
                            w = outside + (1 - outside) * m
                            t, e = r * (width // 2) + c, k * 4 + dy * 2 + dx
                            total += w * float(pred[b, t, e] - velocity[b, t, e]) ** 2
                            weight_sum += w
        losses.append(total / weight_sum)
    return sum(losses) / batch


@pytest.mark.parametrize(("arch", "outside"), [("qwen", 0.0), ("flux", 0.25)])
def test_the_masked_loss_is_the_hand_computed_weighted_mean_over_the_targets_cells(
    arch: str, outside: float, masked_cache: Path
) -> None:
    model = tiny_module(arch, mask_outside_weight=outside)
    model.configure_model()
    batch = first_batch(masked_cache)
    assert torch.equal(batch["conditioning_tensors"][EDIT_MASK], region_mask().expand(2, 8, 8))
    with TransformerCalls(model.transformer) as calls, torch.no_grad():
        loss = model.flow_loss(batch, step_generator(torch.device("cpu"), 7))
    expected = hand_weighted_loss(calls, batch["image_latents"], batch["conditioning_tensors"][EDIT_MASK], outside)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    unmasked = without_masks(batch)
    with torch.no_grad():
        plain = model.flow_loss(unmasked, step_generator(torch.device("cpu"), 7))
    assert plain.item() != pytest.approx(loss.item(), rel=1e-3), "the mask changed nothing"


def without_masks(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its other conditioning tensors but no edit masks."""
    return dict(batch, conditioning_tensors={k: v for k, v in batch["conditioning_tensors"].items() if k != EDIT_MASK})


def garbage_outside(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
    """Huge predictions on the target tokens wholly outside the region (token columns 2 and 3)."""
    out = output[0].clone()
    tokens = out[:, :16].view(out.shape[0], 4, 4, -1)
    tokens[:, :, 2:] = 1e6
    return (out,)


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_at_outside_weight_0_the_loss_ignores_the_predictions_outside_the_region(arch: str, masked_cache: Path) -> None:
    batch = first_batch(masked_cache)
    for outside, ignored in ((0.0, True), (0.1, False)):
        model = tiny_module(arch, mask_outside_weight=outside)
        model.configure_model()
        with torch.no_grad():
            reference = model.flow_loss(batch, step_generator(torch.device("cpu"), 3)).item()
            hook = model.transformer.register_forward_hook(garbage_outside, with_kwargs=True)
            try:
                spoiled = model.flow_loss(batch, step_generator(torch.device("cpu"), 3)).item()
            finally:
                hook.remove()
        assert (spoiled == reference) is ignored, f"outside weight {outside}: {reference} -> {spoiled}"


def test_a_mask_of_ones_or_an_outside_weight_of_1_gives_the_unmasked_loss(masked_cache: Path) -> None:
    batch = first_batch(masked_cache)
    unmasked = without_masks(batch)
    ones = dict(batch, conditioning_tensors={EDIT_MASK: torch.ones(2, 8, 8)})
    for model, masked in ((tiny_module("qwen"), ones), (tiny_module("qwen", mask_outside_weight=1.0), batch)):
        model.configure_model()
        with torch.no_grad():
            plain = model.flow_loss(unmasked, step_generator(torch.device("cpu"), 2)).item()
            weighted = model.flow_loss(masked, step_generator(torch.device("cpu"), 2)).item()
        assert weighted == pytest.approx(plain, rel=1e-6)


def test_a_mask_that_does_not_cover_the_target_latents_or_a_negative_outside_weight_is_refused(
    masked_cache: Path,
) -> None:
    model = tiny_module("qwen")
    model.configure_model()
    batch = first_batch(masked_cache)
    wrong = dict(batch, conditioning_tensors={EDIT_MASK: torch.ones(2, 4, 4)})
    expected = r"conditioning_tensors.edit_mask: expected shape \[2, 8, 8\] \(the batch's target latents' \[B, H, W\]\)"
    with pytest.raises(ValueError, match=expected + r", got \[2, 4, 4\]"):
        model.flow_loss(wrong, step_generator(torch.device("cpu"), 0))
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match=r"mask_outside_weight: expected a finite number >= 0 \(the region"):
            tiny_module("qwen", mask_outside_weight=bad)


# Both kinds of batch in one fit.


class BatchKinds(pl.Callback):
    """Remembers each training batch's context count, whether it had masks, and its loss."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, float]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        kind = (len(batch["context_latents"]), EDIT_MASK in batch["conditioning_tensors"])
        self.seen.append((*kind, outputs["loss"].item()))


@pytest.mark.parametrize("arch", ["qwen", "flux"])
def test_a_fit_trains_on_text_to_image_masked_and_plain_edit_batches(arch: str, tmp_path: Path) -> None:
    small = (CHANNELS, 4, 4)
    mask = torch.zeros(4, 4)
    mask[:2] = 1.0
    cache = cache_of(tmp_path / "cache", [(small, (), None, 2), (small, (small,), mask, 2), (small, (small,), None, 2)])
    model = tiny_module(arch)
    model.configure_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kinds = BatchKinds()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[kinds],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=ImageEditDataModule(str(cache), 2, num_workers=0))
    assert sorted({(n, masked) for n, masked, _ in kinds.seen}) == [(0, False), (1, False), (1, True)]
    assert len(kinds.seen) == 6 and all(torch.isfinite(torch.tensor(loss)) for *_, loss in kinds.seen)
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert moved, "no parameter changed"
