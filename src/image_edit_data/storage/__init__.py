"""Caches beyond one local directory: the packed tar layout, fsspec URLs, remote reads and the local shard cache.

Only the light modules are imported here (the index imports `packed`); the readers are imported
from their modules.
"""

from .packed import LAYOUT, ShardInfo, is_packed

__all__ = ["LAYOUT", "ShardInfo", "is_packed"]
