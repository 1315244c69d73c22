"""The encoder interfaces a cache build plugs into.

An image encoder (`ImageEncoder`) and a text encoder: either a `TextEncoder`, which sees prompts only,
or a `PromptEncoder`, which also sees each sample's condition images and may return named conditioning
tensors and the tokens a length limit cut (`Truncation`). A `PipelineEncoder` (one diffusers pipeline)
is both an image encoder and a prompt encoder.
Any class with these methods works; jsonargparse builds it from a class path and init args.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image


@runtime_checkable
class ImageEncoder(Protocol):
    """Turns a batch of same-sized RGB images into latents.

    `images` is float32 `[B, 3, H, W]` in `[-1, 1]`; the result is `[B, C, H / f, W / f]`
    where `f == spatial_factor`. `H` and `W` are multiples of `spatial_factor`. The result is a new tensor
    (not a buffer the next call overwrites): the build writes it while the encoder goes on.
    """

    spatial_factor: int

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ImageDecoder(Protocol):
    """Turns latents `[B, C, h, w]` back into images `[B, 3, h * f, w * f]` in `[-1, 1]`."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TextEncoder(Protocol):
    """Turns prompts into per-prompt embeddings `[S_i, D]` and attention masks `[S_i]`.

    It cannot report a cut prompt: an encoder that may truncate implements `PromptEncoder` instead. Its tensors
    are new ones, as `ImageEncoder`'s are.
    """

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class PromptTruncationWarning(UserWarning):
    """A prompt lost tokens to a length limit while a cache was built (each such sample gets one)."""


@dataclass(frozen=True)
class Truncation:
    """Tokens one text encoder cut from one prompt: it kept `kept` of the prompt's `tokens`, because of `cause`."""

    encoder: str  # which text encoder cut, e.g. "Qwen2.5-VL", "T5", "CLIP"
    tokens: int  # the prompt's tokens before the cut
    kept: int
    cause: str  # the limit, e.g. "max_sequence_length 512"

    def to_json(self) -> dict[str, Any]:
        """The record stored in a payload's `metadata.prompt_truncation`."""
        return asdict(self)

    def describe(self) -> str:
        """`T5 kept 512 of 600 tokens (max_sequence_length 512)`."""
        return f"{self.encoder} kept {self.kept} of {self.tokens} tokens ({self.cause})"


@dataclass(frozen=True)
class PromptEncoding:
    """One prompt's embeddings `[S, D]`, attention mask `[S]`, named conditioning tensors (any shape), and what
    a length limit cut from it (empty when nothing was cut)."""

    embeddings: torch.Tensor
    mask: torch.Tensor
    conditioning: Mapping[str, torch.Tensor] = field(default_factory=dict)
    truncations: tuple[Truncation, ...] = ()


@runtime_checkable
class PromptEncoder(Protocol):
    """Turns prompts, each with its sample's condition images (raw, possibly none), into `PromptEncoding`s.

    Every result of one cache must carry the same conditioning names, with the same shape and dtype per name.
    An encoder that cuts a prompt says so in `truncations`: the build warns and records it per sample. Its
    tensors are new ones, as `ImageEncoder`'s are.
    """

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]: ...


@runtime_checkable
class PipelineEncoder(Protocol):
    """An image encoder and a prompt encoder in one object, e.g. a diffusers pipeline loaded once."""

    spatial_factor: int

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]: ...
