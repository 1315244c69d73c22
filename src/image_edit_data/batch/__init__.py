"""A bucket's samples -> one batch: collate into one buffer, and that buffer's memory across processes."""

from .buffer import usable_cores
from .collate import AssembledBatch, collate_image_edit

__all__ = ["AssembledBatch", "collate_image_edit", "usable_cores"]
