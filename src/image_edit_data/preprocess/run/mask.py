"""An edit-region mask image -> the float weight map stored beside the target: one value per target latent cell.

The mask covers its target pixel for pixel (white = edited). It follows the target's resize (the part
of the image `ResizePolicy.apply` keeps) and is then averaged over the pixels of each latent cell, in
one exact area average from the raw pixels, so a cell half inside the region gets 0.5 and every value
stays in [0, 1].
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from .resize import ResizePolicy


def area_weights(pixels: int, start: float, end: float, cells: int) -> np.ndarray:
    """`[cells, pixels]`: row i averages the pixels under the i-th of `cells` equal parts of [start, end)."""
    edges = np.linspace(start, end, cells + 1)
    low, high = edges[:-1, None], edges[1:, None]
    left = np.arange(pixels, dtype=np.float64)[None, :]
    overlap = np.clip(np.minimum(high, left + 1) - np.maximum(low, left), 0.0, None)
    return overlap / (high - low)


def latent_mask(mask: Image.Image, policy: ResizePolicy, spatial_factor: int) -> torch.Tensor:
    """Float32 `[H / f, W / f]` in [0, 1] for a mask image the size of its raw target (f = `spatial_factor`)."""
    out_w, out_h = policy.output_size(mask.size, spatial_factor)
    left, top, right, bottom = policy.source_box(mask.size, spatial_factor)
    values = np.asarray(mask.convert("L"), dtype=np.float64) / 255.0  # [h, w]
    rows = area_weights(mask.height, top, bottom, out_h // spatial_factor)
    columns = area_weights(mask.width, left, right, out_w // spatial_factor)
    averaged = np.clip(rows @ values @ columns.T, 0.0, 1.0)  # rounding may step a hair outside
    return torch.from_numpy(averaged.astype(np.float32))
