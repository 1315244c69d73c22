"""`image-edit-data bench`: index, loader and worker-memory measurements on one cache.

`bench_main` is imported on first use: a loader worker that imports one bench module should not
also load the command's parser and report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .command import bench_main

__all__ = ["bench_main"]


def __getattr__(name: str) -> Any:
    if name == "bench_main":
        from .command import bench_main

        return bench_main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
