"""Claims about the reference image-edit model, on synthetic batches in the collate contract (no cache needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from image_edit_data.models.reference import ImageEditFlowModel

CHANNELS = 4
TEXT_DIM = 16


pytestmark = pytest.mark.usefixtures("one_thread")


def make_batch(
    target_hw: tuple[int, int] = (8, 8),
    context_hws: tuple[tuple[int, int], ...] = ((8, 8),),
    seq_len: int = 5,
    batch_size: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """A batch shaped like the collate output, with every prompt fully real (no padding)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "image_latents": torch.randn(batch_size, CHANNELS, *target_hw, generator=g),
        "context_latents": [torch.randn(batch_size, CHANNELS, *hw, generator=g) for hw in context_hws],
        "text_embeddings": torch.randn(batch_size, seq_len, TEXT_DIM, generator=g),
        "text_attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "conditioning_tensors": {},
        "data_type": "image",
        "metadata": {"samples": [{} for _ in range(batch_size)]},
    }


def small_model(**overrides: Any) -> ImageEditFlowModel:
    """A model small enough that each test runs in about a second on CPU."""
    args: dict[str, Any] = {"latent_channels": CHANNELS, "text_dim": TEXT_DIM, "hidden_dim": 32, "depth": 2}
    return ImageEditFlowModel(**(args | overrides))


def perturbed_model() -> ImageEditFlowModel:
    """A small model with its zero-initialised output layers perturbed, so its prediction depends on every input."""
    torch.manual_seed(0)
    model = small_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def predict(model: ImageEditFlowModel, batch: dict[str, Any], t: float = 0.5) -> torch.Tensor:
    """The model's velocity at the batch's target latent, used as x_t."""
    x = batch["image_latents"]
    t_batch = torch.full((x.shape[0],), t)
    return model(x, t_batch, batch["context_latents"], batch["text_embeddings"], batch["text_attention_mask"])


@pytest.mark.parametrize(
    ("target_hw", "context_hws", "seq_len"),
    [((8, 8), ((8, 8),), 5), ((12, 8), ((8, 12), (8, 8)), 3), ((8, 12), ((12, 8), (12, 8)), 9)],
)
def test_forward_and_generate_return_the_target_shape(
    target_hw: tuple[int, int], context_hws: tuple[tuple[int, int], ...], seq_len: int
) -> None:
    model = perturbed_model()
    batch = make_batch(target_hw, context_hws, seq_len, batch_size=3)
    expected = (3, CHANNELS, *target_hw)
    assert predict(model, batch).shape == expected
    assert model.generate(batch, num_steps=3).shape == expected


def test_generate_is_reproducible_with_a_generator() -> None:
    model = perturbed_model()
    batch = make_batch()
    first = model.generate(batch, num_steps=4, generator=torch.Generator().manual_seed(7))
    again = model.generate(batch, num_steps=4, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(first, again)


def test_padded_text_tokens_do_not_change_the_prediction() -> None:
    model = perturbed_model()
    batch = make_batch(seq_len=4)
    padded = dict(batch)
    # Garbage rather than zeros in the padding, so only the mask can be what hides it.
    padding = 100.0 * torch.randn(2, 6, TEXT_DIM)
    padded["text_embeddings"] = torch.cat([batch["text_embeddings"], padding], dim=1)
    padded["text_attention_mask"] = torch.cat([batch["text_attention_mask"], torch.zeros(2, 6, dtype=torch.long)], 1)
    torch.testing.assert_close(predict(model, padded), predict(model, batch), atol=1e-5, rtol=1e-5)

    changed = dict(batch)
    changed["text_embeddings"] = batch["text_embeddings"] + 1.0
    assert not torch.allclose(predict(model, changed), predict(model, batch), atol=1e-3), "the prompt is ignored"


def test_bf16_latents_are_accepted() -> None:
    model = small_model()
    batch = make_batch(context_hws=((8, 8), (12, 8)))
    batch["image_latents"] = batch["image_latents"].bfloat16()
    batch["context_latents"] = [c.bfloat16() for c in batch["context_latents"]]
    loss = model.flow_loss(batch)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    assert model.generate(batch, num_steps=2).dtype == torch.float32


def test_too_many_contexts_are_refused() -> None:
    model = small_model(max_contexts=1)
    with pytest.raises(ValueError, match=r"context_latents: expected at most max_contexts=1, got 2"):
        predict(model, make_batch(context_hws=((8, 8), (8, 8))))


def test_latents_with_the_wrong_channels_or_odd_sides_are_refused() -> None:
    model = small_model()
    batch = make_batch()
    batch["context_latents"] = [torch.randn(2, CHANNELS + 1, 8, 8)]
    with pytest.raises(ValueError, match=r"context_latents\[0\]: expected \[B, 4, H, W\].*got \[2, 5, 8, 8\]"):
        predict(model, batch)
    with pytest.raises(ValueError, match=r"image_latents: .*patch_size=2, got \[2, 4, 7, 8\]"):
        predict(model, make_batch(target_hw=(7, 8)))


def test_hidden_dim_must_split_into_heads() -> None:
    with pytest.raises(ValueError, match=r"hidden_dim: expected a multiple of 4 and of num_heads=3, got 32"):
        small_model(num_heads=3)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_validation_loss_is_the_same_every_call_and_leaves_the_global_rng_alone() -> None:
    model = small_model()
    batch = make_batch()
    rng_before = torch.get_rng_state()
    first = model.validation_step(batch, batch_idx=0)
    again = model.validation_step(batch, batch_idx=0)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert first.item() == again.item()
    assert model.validation_step(batch, batch_idx=1).item() != first.item()


def edit_batch(generator: torch.Generator, batch_size: int = 16) -> dict[str, Any]:
    """A learnable edit: the target is the context with its channels reversed; the prompt carries no information."""
    context = torch.randn(batch_size, CHANNELS, 4, 4, generator=generator)
    return {
        "image_latents": context.flip(1),
        "context_latents": [context],
        "text_embeddings": torch.randn(batch_size, 3, TEXT_DIM, generator=generator),
        "text_attention_mask": torch.ones(batch_size, 3, dtype=torch.long),
    }


@pytest.fixture(scope="module")
def trained_on_edit() -> tuple[ImageEditFlowModel, list[float]]:
    """A model trained for 250 steps on the channel-reversal edit, with its loss curve."""
    torch.manual_seed(0)
    model = small_model(hidden_dim=64, learning_rate=2e-3, warmup_steps=0)
    optimizer = model.configure_optimizers()
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(250):
        loss = model.flow_loss(edit_batch(g), g)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def test_training_on_a_learnable_edit_clearly_lowers_the_loss(
    trained_on_edit: tuple[ImageEditFlowModel, list[float]],
) -> None:
    # With x0 and noise both unit Gaussians, the loss starts at 2, and a model that ignores the context cannot go
    # below about 1.74 at logit-normal times; ending under 0.6 x the start means it reads the context.
    _, losses = trained_on_edit
    start, end = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert end < 0.6 * start, f"loss went from {start:.3f} to {end:.3f}"


def test_samples_from_the_trained_model_move_towards_the_edit(
    trained_on_edit: tuple[ImageEditFlowModel, list[float]],
) -> None:
    model, _ = trained_on_edit
    batch = edit_batch(torch.Generator().manual_seed(123), batch_size=32)
    target = batch["image_latents"]
    samples = model.generate(batch, num_steps=10, generator=torch.Generator().manual_seed(0))
    # Predicting zeros (the data mean) scores 1.0; an unconditional sample scores about 2.0.
    assert torch.mean((samples - target) ** 2).item() < 0.5


def test_trainer_fits_and_logs_train_and_val_loss(tmp_path: Path) -> None:
    batches = [make_batch(context_hws=((8, 8),) * (1 + i % 2), seed=i) for i in range(4)]
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        limit_val_batches=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = small_model(warmup_steps=2)
    # batch_size=None: each item already is a whole collated batch.
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
    assert {"train/loss", "val/loss"} <= set(trainer.callback_metrics)
    first = trainer.validate(model, loader, verbose=False)[0]["val/loss"]
    again = trainer.validate(model, loader, verbose=False)[0]["val/loss"]
    assert first == again
