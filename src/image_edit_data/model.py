"""Deprecated: moved to `image_edit_data.examples.model`; kept for one release so configs keep working."""

import warnings

from .examples.model import ImageEditFlowModel

__all__ = ["ImageEditFlowModel"]

warnings.warn(
    "image_edit_data.model is deprecated and goes away in the next release; use image_edit_data.examples.model",
    FutureWarning,  # shown by default: YAML users who name the old path see it too
    stacklevel=2,
)
