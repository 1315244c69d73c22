"""Fixed, weight-free encoders for the demo data, so the whole pipeline runs on a CPU with no downloads.

The image encoder projects each 8x8 patch onto a few low-frequency DCT basis images in an orthonormal
colour space; the text encoder gives each word a fixed pseudo-random vector from a stable hash.
"""

from __future__ import annotations

import hashlib
import math
import re
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

DEMO_LATENT_CHANNELS = 8
DEMO_SPATIAL_FACTOR = 8
DEMO_TEXT_DIM = 64
# Raw orthonormal coefficients of demo images have a pooled standard deviation of about 3.3 over all 8
# channels (measured on every image of DemoSource(seed=0)); dividing by it gives latents of roughly unit
# variance, the single scaling factor diffusion noise schedules assume. Most of that variance sits in the
# brightness-mean channel (std about 2.4 after scaling); the gradient channels are near zero off shape edges.
DEMO_LATENT_SCALE = 3.3
# Orthonormal colour axes: brightness, red-green, yellow-blue.
_COLOUR_AXES = torch.tensor(
    [
        [1 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)],
        [1 / math.sqrt(2), -1 / math.sqrt(2), 0.0],
        [1 / math.sqrt(6), 1 / math.sqrt(6), -2 / math.sqrt(6)],
    ],
    dtype=torch.float64,
)


def _dct_basis(n: int) -> torch.Tensor:
    """Rows are the orthonormal 1-D DCT-II basis vectors of length `n`, lowest frequency first."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    basis[0] /= math.sqrt(2)
    return basis


def _patch_basis(channels: int, n: int) -> torch.Tensor:
    """The first `channels` of the 3*n*n orthonormal (colour, u, v) basis images, flattened to `[C, 3*n*n]`.

    Order: all three colour means first (so any flat-colour patch is kept exactly), then by frequency
    u + v with chroma frequencies counted twice, luma before chroma; like JPEG, chroma detail goes last.
    """
    dct = _dct_basis(n)
    order = sorted(((u + v) * (1 if c == 0 else 2), c, u, v) for c in range(3) for u in range(n) for v in range(n))
    filters = [_COLOUR_AXES[c][:, None, None] * torch.outer(dct[u], dct[v])[None] for _, c, u, v in order[:channels]]
    return torch.stack(filters).reshape(channels, 3 * n * n)


def _check_images(images: torch.Tensor, factor: int) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"DemoImageEncoder.encode: images: expected [B, 3, H, W], got shape {list(images.shape)}")
    if images.shape[2] % factor or images.shape[3] % factor:
        raise ValueError(
            f"DemoImageEncoder.encode: images: expected H and W to be multiples of {factor}, "
            f"got {images.shape[2]}x{images.shape[3]}"
        )


class DemoImageEncoder:
    """Per 8x8 patch, a fixed orthonormal projection onto low-frequency colour DCT basis images.

    `decode(encode(x))` is the orthogonal projection of `x` onto those basis images: flat-colour
    patches come back exactly, patches crossing a shape edge come back blurred.
    """

    spatial_factor: int = DEMO_SPATIAL_FACTOR

    def __init__(self, latent_channels: int = DEMO_LATENT_CHANNELS) -> None:
        """Build the fixed basis.

        Args:
            latent_channels: Basis images kept per patch, from 3 (colour means only) to 192 (lossless).
        """
        total = 3 * self.spatial_factor**2
        if not 3 <= latent_channels <= total:
            raise ValueError(
                f"DemoImageEncoder: latent_channels: expected 3 to {total} (3 keeps only flat colour), "
                f"got {latent_channels}"
            )
        self.latent_channels = latent_channels
        self._basis = _patch_basis(latent_channels, self.spatial_factor)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Float images `[B, 3, H, W]` in `[-1, 1]` -> float32 latents `[B, C, H / 8, W / 8]`."""
        _check_images(images, self.spatial_factor)
        f = self.spatial_factor
        b, h, w = images.shape[0], images.shape[2] // f, images.shape[3] // f
        basis = self._basis.to(images.device)
        # A 2-D matmul over flattened patches, not a strided conv or a batched matmul on a permuted view:
        # same numbers, but those two are far slower on small CPU batches when threads are contended.
        # In float64, rounded once to float32: a float32 kernel's summation order depends on how many patches
        # one call holds, so an image's latents would change in their last bits with the images encoded beside it.
        patches = images.to(basis.dtype).reshape(b, 3, h, f, w, f).permute(0, 2, 4, 1, 3, 5).reshape(b * h * w, -1)
        latents = (patches @ basis.T / DEMO_LATENT_SCALE).to(torch.float32)
        return latents.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[B, C, h, w]` -> float32 images `[B, 3, 8h, 8w]`, clamped to `[-1, 1]`."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"DemoImageEncoder.decode: latents: expected [B, {self.latent_channels}, h, w], "
                f"got shape {list(latents.shape)}"
            )
        f = self.spatial_factor
        b, _, h, w = latents.shape
        basis = self._basis.to(latents.device)
        # The basis rows are orthonormal, so multiplying by the basis itself inverts `encode` on their span.
        patches = (latents.to(basis.dtype).permute(0, 2, 3, 1).reshape(b * h * w, -1) * DEMO_LATENT_SCALE) @ basis
        images = patches.reshape(b, h, w, 3, f, f).permute(0, 3, 1, 4, 2, 5).reshape(b, 3, h * f, w * f)
        return images.clamp(-1.0, 1.0).to(torch.float32)


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """An image (converted to RGB) -> float32 `[3, H, W]` in `[-1, 1]`."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels).permute(2, 0, 1) / 127.5 - 1.0


def tensor_to_pil(image: torch.Tensor) -> Image.Image:
    """Float `[3, H, W]` in `[-1, 1]` (values outside are clamped) -> an RGB image."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"tensor_to_pil: image: expected [3, H, W], got shape {list(image.shape)}")
    pixels = ((image.detach().cpu().float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy())


@lru_cache(maxsize=65536)
def _word_vector(word: str, dim: int) -> torch.Tensor:
    """A fixed unit vector for `word`: SHAKE-256 bytes (unsalted, unlike `hash`) read as uniform numbers."""
    raw = hashlib.shake_256(f"demo-text:{word}".encode()).digest(4 * dim)
    values = np.frombuffer(raw, dtype="<u4").astype(np.float64) / 2.0**32 * 2.0 - 1.0
    return torch.from_numpy(values / np.linalg.norm(values)).to(torch.float32)


def _positions(length: int, dim: int) -> torch.Tensor:
    """Sinusoidal position codes `[length, dim]`, each of norm 0.1 so word identity dominates."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    index = torch.arange(dim, dtype=torch.float64)[None, :]
    angle = position / 10000.0 ** ((index - index % 2) / dim)
    codes = torch.where(index % 2 == 0, torch.sin(angle), torch.cos(angle))
    return (0.1 * codes / codes.norm(dim=1, keepdim=True)).to(torch.float32)


class DemoTextEncoder:
    """Lower-cased words -> fixed pseudo-random unit vectors plus a small position code."""

    def __init__(self, dim: int = DEMO_TEXT_DIM, max_length: int = 32) -> None:
        """Precompute the position codes.

        Args:
            dim: Embedding width.
            max_length: Words kept per prompt; later words are dropped.
        """
        if dim < 2:
            raise ValueError(f"DemoTextEncoder: dim: expected at least 2, got {dim}")
        if max_length < 1:
            raise ValueError(f"DemoTextEncoder: max_length: expected at least 1, got {max_length}")
        self.dim = dim
        self.max_length = max_length
        self._positions = _positions(max_length, dim)

    def encode(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per prompt, float32 embeddings `[S, dim]` and an int64 mask of ones `[S]`, S = words (<= max_length)."""
        results = []
        for number, prompt in enumerate(prompts):
            words = re.findall(r"\w+", prompt.lower())[: self.max_length]
            if not words:
                raise ValueError(
                    f"DemoTextEncoder.encode: prompts[{number}]: expected at least one word, got {prompt!r}"
                )
            vectors = torch.stack([_word_vector(word, self.dim) for word in words])
            results.append((vectors + self._positions[: len(words)], torch.ones(len(words), dtype=torch.int64)))
        return results
