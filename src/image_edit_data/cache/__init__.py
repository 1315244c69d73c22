"""Building, validating and inspecting image-edit caches."""

from .build import BuildOptions, build_cache
from .cli import cache_main, demo_cache_main
from .convert import convert_cache
from .encoders import ImageDecoder, ImageEncoder, PipelineEncoder, PromptEncoder, PromptEncoding, TextEncoder
from .pipeline_encoders import DiffusersPipelineEncoder
from .sources import EditSource

__all__ = [
    "BuildOptions",
    "DiffusersPipelineEncoder",
    "EditSource",
    "ImageDecoder",
    "ImageEncoder",
    "PipelineEncoder",
    "PromptEncoder",
    "PromptEncoding",
    "TextEncoder",
    "build_cache",
    "cache_main",
    "convert_cache",
    "demo_cache_main",
]
