"""Deprecated: moved to `image_edit_data.lightning.monitor`; kept for one release so configs keep working."""

import warnings

from .lightning.monitor import ImageEditDataMonitor

__all__ = ["ImageEditDataMonitor"]

warnings.warn(
    "image_edit_data.monitor is deprecated and goes away in the next release; use image_edit_data.lightning.monitor",
    FutureWarning,  # shown by default: YAML users who name the old path see it too
    stacklevel=2,
)
