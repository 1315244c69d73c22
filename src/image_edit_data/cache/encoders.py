"""The two encoder interfaces a cache build plugs into.

Any class with these methods works; jsonargparse builds it from a class path and init args.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ImageEncoder(Protocol):
    """Turns a batch of same-sized RGB images into latents.

    `images` is float32 `[B, 3, H, W]` in `[-1, 1]`; the result is `[B, C, H / f, W / f]`
    where `f == spatial_factor`. `H` and `W` are multiples of `spatial_factor`.
    """

    spatial_factor: int

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ImageDecoder(Protocol):
    """Turns latents `[B, C, h, w]` back into images `[B, 3, h * f, w * f]` in `[-1, 1]`."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TextEncoder(Protocol):
    """Turns prompts into per-prompt embeddings `[S_i, D]` and attention masks `[S_i]`."""

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...
