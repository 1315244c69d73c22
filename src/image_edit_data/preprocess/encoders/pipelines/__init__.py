"""Pipeline encoder families: one small class per diffusers pipeline family (see `../pipeline_encoders.py`)."""

from .flux_kontext import FluxKontextEncoder
from .qwen_image_edit import QwenImageEditEncoder

__all__ = ["FluxKontextEncoder", "QwenImageEditEncoder"]
