"""Running a build: read and resize, encode in same-size batches, write payloads, journal progress, merge the index."""

from .build_cache import BuildOptions, BuildReport, build_cache
from .resize import ResizePolicy

__all__ = ["BuildOptions", "BuildReport", "ResizePolicy", "build_cache"]
