"""Tools for a cache that exists: validate it, inspect its buckets, convert its payload format, pack it into shards."""

from .convert import convert_cache
from .pack import pack_cache
from .validate import check_cache
from .verify_shards import check_shards

__all__ = ["check_cache", "check_shards", "convert_cache", "pack_cache"]
