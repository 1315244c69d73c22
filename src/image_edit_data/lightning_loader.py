"""Deprecated: moved to `image_edit_data.lightning.loader`; kept for one release so configs keep working."""

import warnings

from .lightning.loader import LightningLoader

__all__ = ["LightningLoader"]

warnings.warn(
    "image_edit_data.lightning_loader is deprecated and goes away in the next release; "
    "use image_edit_data.lightning.loader",
    FutureWarning,  # shown by default: YAML users who name the old path see it too
    stacklevel=2,
)
