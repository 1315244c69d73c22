"""The encoders a cache build plugs in: their interfaces, the demo encoders, model-backed ones and diffusers pipelines.

The pipeline families (Qwen-Image-Edit, FLUX.1 Kontext) are in `pipelines/`.
"""

from .base import ImageDecoder, ImageEncoder, PipelineEncoder, PromptEncoder, PromptEncoding, TextEncoder
from .demo import DemoImageEncoder, DemoTextEncoder
from .hf import DiffusersVAEEncoder, TransformersTextEncoder
from .pipeline import DiffusersPipelineEncoder

__all__ = [
    "DemoImageEncoder",
    "DemoTextEncoder",
    "DiffusersPipelineEncoder",
    "DiffusersVAEEncoder",
    "ImageDecoder",
    "ImageEncoder",
    "PipelineEncoder",
    "PromptEncoder",
    "PromptEncoding",
    "TextEncoder",
    "TransformersTextEncoder",
]
