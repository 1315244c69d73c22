"""Our batches as diffusers edit-transformer inputs: 2x2 latent packing, Kontext position ids, flow-matching times,
and the loss weights of an edit-region mask.

Pure tensor functions, so each can be checked against diffusers' own pipelines without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

TimestepSampling = Literal["logit_normal", "uniform"]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, H, W]` -> `[B, (H/2) * (W/2), 4C]`: row-major 2x2 patches, channels outermost, as the pipelines pack."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def packed_grids(image_latents: torch.Tensor, context_latents: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Token grid `(H/2, W/2)` of the target, then of each context, in the order their tokens are concatenated."""
    return [(int(x.shape[-2]) // 2, int(x.shape[-1]) // 2) for x in (image_latents, *context_latents)]


def qwen_img_shapes(grids: Sequence[tuple[int, int]], batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Qwen-Image's `img_shapes`: per sample, `(frames=1, rows, cols)` of the target then of each context."""
    per_sample = [(1, rows, cols) for rows, cols in grids]
    return [list(per_sample) for _ in range(batch_size)]


def kontext_image_ids(grids: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Flux `img_ids` `[tokens, 3]`: `(image, row, col)` per token; 0 marks the target and `k + 1` context k.

    FLUX.1 Kontext sets the first coordinate to 1 on its one context image; further contexts count on (2, 3, ...)
    so the rotary embedding keeps every image apart.
    """
    ids = []
    for image, (rows, cols) in enumerate(grids):
        grid = torch.zeros(rows, cols, 3, device=device)
        grid[..., 0] = image
        grid[..., 1] = torch.arange(rows, device=device)[:, None]
        grid[..., 2] = torch.arange(cols, device=device)[None, :]
        ids.append(grid.reshape(rows * cols, 3))
    return torch.cat(ids)


def packed_loss_weights(mask: torch.Tensor, latent_shape: Sequence[int], outside_weight: float) -> torch.Tensor:
    """Per-element loss weights `[B, H/2 * W/2, 4C]` for a batch's edit masks `[B, H, W]` (1 = edited).

    A latent cell weighs 1 inside the region, `outside_weight` outside, and in between as its mask value says
    (`outside + (1 - outside) * mask`). The map is packed exactly as the latents are (`pack_latents`, one copy
    per channel), so every element of a target token gets the weight of the latent cell it came from.
    """
    b, c, h, w = latent_shape
    if tuple(mask.shape) != (b, h, w):
        raise ValueError(
            f"conditioning_tensors.edit_mask: expected shape {[b, h, w]} (the batch's target latents' [B, H, W]), "
            f"got {list(mask.shape)}"
        )
    weights = outside_weight + (1.0 - outside_weight) * mask.float()
    return pack_latents(weights[:, None].expand(b, c, h, w))


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error; with `weights`, each sample's weighted mean (sum of w * err^2 over sum of w), averaged.

    Each sample's weights are normalised by their own sum, so a small edited region weighs as much as a large one
    and weights of 1 everywhere give the plain mean. A sample whose weights are all 0 adds 0 to the batch mean.
    """
    if weights is None:
        return F.mse_loss(pred, target)
    squared = (pred - target).square() * weights
    total = weights.flatten(1).sum(dim=1).clamp_min(torch.finfo(weights.dtype).tiny)
    return (squared.flatten(1).sum(dim=1) / total).mean()


@dataclass(frozen=True)
class ResolutionShift:
    """A scheduler's resolution-dependent shift: `mu` linear in the target's token count between two anchor points.

    The values are the `base_image_seq_len`, `max_image_seq_len`, `base_shift` and `max_shift` of the model's
    `scheduler/scheduler_config.json`; the pipelines shift their inference sigmas with the same `mu`.
    """

    base_seq_len: int
    max_seq_len: int
    base_shift: float
    max_shift: float

    def mu(self, image_tokens: int) -> float:
        """The shift exponent for `image_tokens` target tokens."""
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return self.base_shift + slope * (image_tokens - self.base_seq_len)


def sample_sigmas(
    batch_size: int,
    image_tokens: int,
    generator: torch.Generator,
    sampling: TimestepSampling = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: ResolutionShift | None = None,
) -> torch.Tensor:
    """Noise levels `[B]` in (0, 1), float32 on the generator's device: logit-normal or uniform, then shifted.

    The shift `sigma = e^mu / (e^mu + 1 / u - 1)` moves samples towards noise for larger images, the exponential
    time shift Flux and Qwen-Image use at inference, so training sees the noise levels sampling visits.
    """
    device = generator.device
    if sampling == "logit_normal":
        normal = torch.randn(batch_size, generator=generator, device=device, dtype=torch.float32)
        u = torch.sigmoid(logit_mean + logit_std * normal)
    elif sampling == "uniform":
        u = torch.rand(batch_size, generator=generator, device=device, dtype=torch.float32)
    else:
        raise ValueError(f"timestep_sampling: expected 'logit_normal' or 'uniform', got {sampling!r}")
    # Keep t away from 0 and 1, where 1 / u - 1 diverges and x_t would be exactly data or exactly noise.
    u = u.clamp(1e-5, 1 - 1e-5)
    if shift is None:
        return u
    factor = math.exp(shift.mu(image_tokens))
    return factor / (factor + (1 / u - 1))


def step_generator(device: torch.device, *parts: int) -> torch.Generator:
    """A generator on `device` seeded from `parts` (seed, step, rank, ...), so a resumed run draws the same noise."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)
