"""The encoder interfaces a cache build plugs into.

An image encoder (`ImageEncoder`) and a text encoder: either a `TextEncoder`, which sees prompts only,
or a `PromptEncoder`, which also sees each sample's condition images and may return named conditioning
tensors. A `PipelineEncoder` (one diffusers pipeline) is both an image encoder and a prompt encoder.
Any class with these methods works; jsonargparse builds it from a class path and init args.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from PIL import Image


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


@dataclass(frozen=True)
class PromptEncoding:
    """One prompt's embeddings `[S, D]`, attention mask `[S]` and named conditioning tensors (any shape)."""

    embeddings: torch.Tensor
    mask: torch.Tensor
    conditioning: Mapping[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class PromptEncoder(Protocol):
    """Turns prompts, each with its sample's condition images (raw, possibly none), into `PromptEncoding`s.

    Every result of one cache must carry the same conditioning names, with the same shape and dtype per name.
    """

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]: ...


@runtime_checkable
class PipelineEncoder(Protocol):
    """An image encoder and a prompt encoder in one object, e.g. a diffusers pipeline loaded once."""

    spatial_factor: int

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]: ...
