"""How raw images are brought to encoder-ready pixel sizes, and turned into pixel tensors.

Four policies: `max_pixels` keeps the aspect ratio within a pixel budget; `max_pixels_floor` does
too, rounding each side down as NeMo Automodel's Qwen-Image-Edit preprocessor does; `presets` picks
the resolution of closest aspect ratio from a list, scales to cover it and centre-crops; `none` keeps
the image and requires it to be aligned already. Every result has sides that are multiples of
both `spatial_alignment` and the image encoder's spatial factor. Target and contexts are resized
independently by the same policy, so they may end up with different sizes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

ResizeMode = Literal["max_pixels", "max_pixels_floor", "presets", "none"]


@dataclass(frozen=True)
class ResizePolicy:
    """Where each image's pixel size comes from."""

    mode: ResizeMode = "max_pixels"
    """`max_pixels`, `max_pixels_floor`, `presets` or `none` (see the module docstring)."""
    max_pixels: int = 1024 * 1024
    """Pixel budget per image in the `max_pixels` modes."""
    spatial_alignment: int = 32
    """Every output side is a multiple of this (and of the encoder's spatial factor)."""
    presets: tuple[tuple[int, int], ...] = ()
    """(width, height) resolutions for `presets` mode."""
    upscale: bool = False
    """In the `max_pixels` modes, also enlarge images smaller than the budget (as Qwen-Image-Edit does)."""

    def alignment(self, spatial_factor: int) -> int:
        """The step every side must be a multiple of."""
        return math.lcm(self.spatial_alignment, spatial_factor)

    def check(self, spatial_factor: int) -> None:
        """Refuse settings that cannot produce aligned sizes, naming the setting."""
        if self.spatial_alignment < 1:
            raise ValueError(f"spatial_alignment: expected a positive integer, got {self.spatial_alignment}")
        step = self.alignment(spatial_factor)
        if self.mode in ("max_pixels", "max_pixels_floor") and self.max_pixels < step * step:
            raise ValueError(
                f"max_pixels: expected at least {step * step} (one {step}x{step} cell), got {self.max_pixels}"
            )
        if self.mode == "presets":
            if not self.presets:
                raise ValueError("presets: expected at least one (width, height) for resize mode 'presets', got none")
            for i, (width, height) in enumerate(self.presets):
                if width <= 0 or height <= 0 or width % step or height % step:
                    raise ValueError(f"presets[{i}]: expected positive multiples of {step}, got {width}x{height}")

    def output_size(self, size: tuple[int, int], spatial_factor: int) -> tuple[int, int]:
        """(width, height) an image of `size` becomes; ValueError if mode `none` finds it misaligned."""
        width, height = size
        step = self.alignment(spatial_factor)
        if self.mode == "none":
            if width % step or height % step:
                raise ValueError(
                    f"is {width}x{height} pixels, not a multiple of {step}; resize mode 'none' needs aligned images"
                )
            return size
        if self.mode == "presets":
            aspect = math.log(width / height)
            return min(self.presets, key=lambda p: abs(math.log(p[0] / p[1]) - aspect))
        scale = math.sqrt(self.max_pixels / (width * height))
        if not self.upscale:
            scale = min(scale, 1.0)
        if self.mode == "max_pixels_floor":
            return floor_to_budget(width * scale, height * scale, step, self.max_pixels)
        return fit_budget(width * scale, height * scale, step, self.max_pixels)

    def apply(self, image: Image.Image, spatial_factor: int) -> Image.Image:
        """The image at its output size (unchanged if already there)."""
        out_w, out_h = self.output_size(image.size, spatial_factor)
        if (out_w, out_h) == image.size:
            return image
        if self.mode != "presets":
            return image.resize((out_w, out_h), Image.Resampling.LANCZOS)
        cover, (left, top) = _cover(image.size, (out_w, out_h))
        resized = image.resize(cover, Image.Resampling.LANCZOS)
        return resized.crop((left, top, left + out_w, top + out_h))

    def source_box(self, size: tuple[int, int], spatial_factor: int) -> tuple[float, float, float, float]:
        """(left, top, right, bottom): the part of an image of `size`, in its own pixels, that `apply` keeps."""
        out_w, out_h = self.output_size(size, spatial_factor)
        width, height = size
        if (out_w, out_h) == size or self.mode != "presets":
            return 0.0, 0.0, float(width), float(height)
        (cover_w, cover_h), (left, top) = _cover(size, (out_w, out_h))
        x, y = width / cover_w, height / cover_h
        return left * x, top * y, (left + out_w) * x, (top + out_h) * y

    def to_json(self) -> dict[str, Any]:
        """Provenance form (presets as lists)."""
        data = asdict(self)
        data["presets"] = [list(p) for p in self.presets]
        return data


def _cover(size: tuple[int, int], out: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The size that covers `out` keeping the aspect of `size`, and the crop's (left, top) that centres `out` in it."""
    scale = max(out[0] / size[0], out[1] / size[1])
    cover = (max(out[0], round(size[0] * scale)), max(out[1], round(size[1] * scale)))
    return cover, ((cover[0] - out[0]) // 2, (cover[1] - out[1]) // 2)


def fit_budget(width: float, height: float, step: int, budget: int) -> tuple[int, int]:
    """Aligned (width, height) near the given size, within `budget` pixels, keeping the aspect ratio closest.

    Each side is rounded down or up to a multiple of `step` (at least one step); of the combinations
    within the budget, the one whose aspect ratio is nearest wins, the larger one on a tie.
    """
    aspect = math.log(width / height)
    sides_w = {max(step, math.floor(width / step) * step), max(step, math.ceil(width / step) * step)}
    sides_h = {max(step, math.floor(height / step) * step), max(step, math.ceil(height / step) * step)}
    fits = [(w, h) for w in sides_w for h in sides_h if w * h <= budget]
    if not fits:  # a very thin image: the short side is already one step, so shorten the long one
        short_w = width < height
        long_side = max(step, budget // step // step * step)
        return (step, long_side) if short_w else (long_side, step)
    return min(fits, key=lambda s: (abs(math.log(s[0] / s[1]) - aspect), -s[0] * s[1]))


def floor_to_budget(width: float, height: float, step: int, budget: int) -> tuple[int, int]:
    """Each side rounded down to a multiple of `step` (at least one step), then the longer one shortened to fit."""
    out_w = max(step, math.floor(width / step) * step)
    out_h = max(step, math.floor(height / step) * step)
    while out_w * out_h > budget and (out_w > step or out_h > step):
        if out_w >= out_h and out_w > step:
            out_w -= step
        else:
            out_h -= step
    return out_w, out_h


def to_pixels(images: list[Image.Image]) -> torch.Tensor:
    """Same-sized RGB images -> float32 `[B, 3, H, W]` in `[-1, 1]`, the encoders' input.

    The values and the (channels-last) strides of
    `torch.from_numpy(stacked).permute(0, 3, 1, 2).to(torch.float32) / 127.5 - 1.0`: the same correctly
    rounded float32 division and subtraction, as two numpy ufuncs on this thread, which run without the GIL
    (the encoder's thread is not held up) and without torch's thread pool (whose threads would spin beside
    the build's readers).
    """
    rows = pixel_rows(len(images), images[0].size)
    for k, image in enumerate(images):
        put_pixels(image, rows[k])
    return pixel_batch(rows)


def pixel_rows(count: int, size: tuple[int, int]) -> np.ndarray:
    """Room for `count` images of `size` (width, height): float32 `[B, H, W, 3]`, filled by `put_pixels`."""
    width, height = size
    return np.empty((count, height, width, 3), dtype=np.float32)


def put_pixels(image: Image.Image, row: np.ndarray) -> None:
    """Write `image`'s pixels into its `row` of `pixel_rows` (any thread: the ufuncs release the GIL)."""
    rgb = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    np.divide(rgb, np.float32(127.5), out=row, dtype=np.float32)
    np.subtract(row, np.float32(1.0), out=row)


def pixel_batch(rows: np.ndarray) -> torch.Tensor:
    """The filled `pixel_rows` as the encoders' `[B, 3, H, W]` tensor (a view: nothing is copied)."""
    return torch.from_numpy(rows).permute(0, 3, 1, 2)
