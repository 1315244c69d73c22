"""The cache tools: build a cache from raw edit data (`sources/` -> `encoders/` -> `run/`) and work on one (`tools/`).

"cache" elsewhere in the package means the data on disk; this subpackage makes and checks it.
"""

from .cli import cache_main, demo_cache_main
from .demo_cache import write_demo_cache
from .encoders.base import ImageDecoder, ImageEncoder, PipelineEncoder, PromptEncoder, PromptEncoding, TextEncoder
from .encoders.pipeline import DiffusersPipelineEncoder
from .run.build_cache import BuildOptions, build_cache
from .sources.base import EditSource
from .tools.convert import convert_cache

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
    "write_demo_cache",
]
