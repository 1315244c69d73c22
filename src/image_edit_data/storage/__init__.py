"""Where a cache's bytes live: local files or tar shards, or a URL through fsspec, with the node-local shard cache.

Only light names are imported here; the readers and the shard cache are imported from their modules.
"""

from .location import DEFAULT_SHARD_CACHE_BYTES, REMOTE_READS, RemoteRead

__all__ = ["DEFAULT_SHARD_CACHE_BYTES", "REMOTE_READS", "RemoteRead"]
