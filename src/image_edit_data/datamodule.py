"""Deprecated: moved to `image_edit_data.lightning.datamodule`; kept for one release so configs keep working."""

import warnings

from .lightning.datamodule import ImageEditDataModule

__all__ = ["ImageEditDataModule"]

warnings.warn(
    "image_edit_data.datamodule is deprecated and goes away in the next release; "
    "use image_edit_data.lightning.datamodule",
    FutureWarning,  # shown by default: YAML users who name the old path see it too
    stacklevel=2,
)
