"""Edit masks as each data set defines them, turned into the build's form: grey levels over the target, white = edited.

- `grey` (a manifest's `mask` entry, `--mask-column`): already the build's form, the target's size.
- `magicbrush` (MagicBrush's `mask_img`): an RGBA *masked image*, the source photo with the edit region erased,
  possibly of another size. As its maintainers convert it (OSU-NLP-Group/MagicBrush issue 10, the
  `rgba_to_01_mask` they point to): resized to the image (Pillow's default filter), then edited where the
  alpha is below 255. A mask without alpha is refused: its polarity would be a guess.
- `ultraedit` (UltraEdit's `mask_image`): white = the region to edit, as its training script reads it
  (`train_sd3_pix2pix.py`: the mask converted to RGB and resized with the images); a row without a mask is
  edited everywhere (that script substitutes an all-white image), so it gets a mask of ones.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from PIL import Image

from .base import INVALID_ENTRY, BadSampleError

MaskForm = Literal["grey", "magicbrush", "ultraedit"]


def build_mask(
    mask: Image.Image | None, size: tuple[int, int], form: MaskForm, where: str, field: str
) -> Image.Image | None:
    """The mask in the build's form (mode L) for a target of `size`, or None for an unmasked sample."""
    if mask is None:
        return Image.new("L", size, 255) if form == "ultraedit" else None
    if form == "magicbrush":
        return transparent_region(mask, size, where, field)
    if form == "ultraedit":
        rgb = mask.convert("RGB")
        return (rgb if rgb.size == size else rgb.resize(size)).convert("L")
    return mask


def transparent_region(mask: Image.Image, size: tuple[int, int], where: str, field: str) -> Image.Image:
    """White where the RGBA masked image, resized to `size`, is not fully opaque; black elsewhere."""
    if "A" not in mask.getbands() and "transparency" not in mask.info:
        raise BadSampleError(
            where,
            INVALID_ENTRY,
            f"{field}: expected an RGBA masked image (MagicBrush's form: the edit region transparent), got a "
            f"{mask.mode} image without alpha",
        )
    rgba = mask.convert("RGBA")
    if rgba.size != size:
        rgba = rgba.resize(size)
    alpha = np.asarray(rgba)[:, :, 3]
    return Image.fromarray(np.where(alpha != 255, 255, 0).astype(np.uint8), "L")
